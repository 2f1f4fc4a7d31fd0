"""remote.py against a real S3-compatible server (moto's, on 127.0.0.1, authentication on) through
boto3: every checkpoint uploaded byte for byte, a resume from storage equal to the uninterrupted
run, a cut upload never complete, bad buckets and credentials caught before training, and the
credentials in no output or file. What a bucket holds is hostile: keys that lead out of out_dir,
manifests that lie, and another run's checkpoints under the same URL."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import boto3
import pytest

import checkpoint
import remote
import s3server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--arch.n_layer=2', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64', '--batch_size=4',
        '--block_size=32', '--eval_iters=2', '--log_interval=1', '--warmup_steps=2', '--eval_interval=2',
        '--sample.tokens=0', '--max_steps=8']


@pytest.fixture(scope='module')
def s3():
    """A server that takes any credentials (random strings here)."""
    process, proxy, env = s3server.start()
    yield proxy, env
    process.terminate()
    process.wait()


@pytest.fixture(scope='module')
def s3_auth():
    """A server that checks credentials."""
    process, proxy, env = s3server.start(auth=True)
    yield proxy, env
    process.terminate()
    process.wait()


def train(env, *args):
    return subprocess.run([sys.executable, 'train.py', *TINY, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def log(folder):
    with open(os.path.join(folder, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def remote_files(s3, prefix):
    """{key under prefix: bytes} in bucket runs, read from the server itself (not the proxy)."""
    proxy, env = s3
    direct = dict(env, AWS_ENDPOINT_URL=f'http://127.0.0.1:{proxy.target}')
    client = boto3.client('s3', **s3server.client_args(direct))
    keys = [o['Key'] for o in client.list_objects_v2(Bucket='runs', Prefix=prefix).get('Contents', [])]
    return {k[len(prefix):]: client.get_object(Bucket='runs', Key=k)['Body'].read() for k in keys}


def every_byte(folder):
    return b''.join(open(os.path.join(d, f), 'rb').read() for d, _, fs in os.walk(folder) for f in fs)


@pytest.mark.slow
def test_every_checkpoint_uploaded_byte_for_byte_and_a_resume_from_storage_equals_the_straight_run(s3, tmp_path):
    proxy, env = s3
    straight = train(env, f'--out_dir={tmp_path / "straight"}')
    assert straight.returncode == 0, straight.stderr
    first = train(env, f'--out_dir={tmp_path / "a"}', '--upload_to=s3://runs/exp', '--stop_after=4', '--ckpt.keep_last=1')
    assert first.returncode == 0, first.stderr
    files = remote_files(s3, 'exp/')
    local = checkpoint.checkpoints(tmp_path / 'a')
    assert sorted({k.split('/')[0] for k in files if k.startswith('ckpt_')}) == [os.path.basename(c) for c in local]
    for ckpt in local:  # byte for byte, the manifest's every file and the manifest itself
        manifest = json.loads(files[f'{os.path.basename(ckpt)}/manifest.json'])
        for name, (size, sha) in manifest.items():
            data = files[f'{os.path.basename(ckpt)}/{name}']
            assert data == open(os.path.join(ckpt, name), 'rb').read()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha)
    assert files['latest'] == b'ckpt_0000004'
    assert f"uploads done: s3://runs/exp/ckpt_0000004" in first.stdout
    secrets = [env['AWS_ACCESS_KEY_ID'], env['AWS_SECRET_ACCESS_KEY']]
    assert not any(s.encode() in every_byte(tmp_path / 'a') for s in secrets)
    shutil.rmtree(tmp_path / 'a')  # the machine is gone; the bucket holds the run
    resumed = train(env, f'--out_dir={tmp_path / "b"}', '--init_from=s3://runs/exp', '--upload_to=s3://runs/exp')
    assert resumed.returncode == 0, resumed.stderr
    assert 'resumed from' in resumed.stdout
    a, b = log(tmp_path / 'straight'), log(tmp_path / 'b')
    assert [r['step'] for r in b] == [5, 6, 7, 8]  # a fresh out_dir: the log of the steps it ran
    assert [r['loss'] for r in a[4:]] == [r['loss'] for r in b]  # bit for bit
    assert remote_files(s3, 'exp/')['latest'] == b'ckpt_0000008'
    for out in (first, resumed):  # the credentials in no output, log or checkpoint
        assert not any(s in out.stdout + out.stderr for s in secrets)
    assert not any(s.encode() in every_byte(tmp_path / 'b') for s in secrets)


def test_a_missing_bucket_or_a_wrong_credential_ends_the_run_before_training(s3, s3_auth, tmp_path):
    proxy, env = s3_auth
    r = train(env, f'--out_dir={tmp_path / "x"}', '--upload_to=s3://no-such-bucket/exp')
    assert r.returncode == 1 and r.stderr.count('\n') == 1
    assert r.stderr.startswith('error: cannot use s3://no-such-bucket/exp (') and '404' in r.stderr
    assert not os.path.exists(tmp_path / 'x' / 'log.jsonl')
    wrong = dict(env, AWS_SECRET_ACCESS_KEY=os.urandom(20).hex())
    r = train(wrong, f'--out_dir={tmp_path / "y"}', '--upload_to=s3://runs/exp')
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and '403' in r.stderr
    assert wrong['AWS_SECRET_ACCESS_KEY'] not in r.stdout + r.stderr
    assert not os.path.exists(tmp_path / 'y' / 'log.jsonl')
    r = train(s3[1], f'--out_dir={tmp_path / "z"}', '--init_from=s3://runs/nothing-here')
    assert r.returncode == 1 and r.stderr == ("error: no complete checkpoint under s3://runs/nothing-here; "
                                              "train first, or set --init_from=scratch\n")


def fake_checkpoint(folder, step, size=1 << 20):
    """A checkpoint written by checkpoint.save, with one file of `size` random bytes."""
    os.makedirs(folder, exist_ok=True)
    def write(directory):
        os.makedirs(directory)
        with open(os.path.join(directory, 'model.safetensors'), 'wb') as f:
            f.write(os.urandom(size))
    assert checkpoint.save(str(folder), step, write, {'step': step}, keep=5) is None


def test_a_cut_upload_warns_once_is_never_complete_and_the_next_one_uploads(s3, tmp_path, capsys):
    proxy, env = s3
    os.environ.update(env)
    try:
        uploader = remote.Uploader('s3://runs/cut', 'cut-run', retries=2, backoff=0.05)
        fake_checkpoint(tmp_path, 1)
        uploader.submit(str(tmp_path), 1, 1)
        uploader.wait()
        proxy.rate = 256 << 10  # 4 s for the next checkpoint's 1 MiB
        fake_checkpoint(tmp_path, 2)
        t0 = time.time()
        uploader.submit(str(tmp_path), 2, 1)
        assert time.time() - t0 < 0.5  # training does not wait
        time.sleep(1.0)
        proxy.cut()  # the server gone mid-transfer
        uploader.wait()
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and err.startswith('warning: uploading ckpt_0000002 to s3://runs/cut failed')
        files = remote_files(s3, 'cut/')
        assert 'ckpt_0000002/manifest.json' not in files and files['latest'] == b'ckpt_0000001'
        proxy.rate = None
        proxy.restore()
        assert remote.download_latest('s3://runs/cut', str(tmp_path / 'back')).endswith('ckpt_0000001')
        fake_checkpoint(tmp_path, 3)
        uploader.submit(str(tmp_path), 3, 1)
        uploader.close()
        files = remote_files(s3, 'cut/')
        assert files['latest'] == b'ckpt_0000003' and 'ckpt_0000003/manifest.json' in files
        assert files['ckpt_0000003/model.safetensors'] == open(tmp_path / 'ckpt_0000003' / 'model.safetensors', 'rb').read()
        assert capsys.readouterr().err == ''
    finally:
        proxy.rate = None
        proxy.restore()
        for k in env:
            os.environ.pop(k)


def test_any_fsspec_url_works_the_same_way(tmp_path):
    fake_checkpoint(tmp_path / 'run', 3)
    fake_checkpoint(tmp_path / 'run', 7)
    url = f'file://{tmp_path}/bucket/exp'
    uploader = remote.Uploader(url, 'fsspec-run')
    uploader.submit(str(tmp_path / 'run'), 3, 3)
    uploader.wait()
    uploader.submit(str(tmp_path / 'run'), 7, 3)
    uploader.close()
    with open(tmp_path / 'run' / 'ckpt_0000007' / 'model.safetensors', 'rb') as f:
        assert open(tmp_path / 'bucket' / 'exp' / 'ckpt_0000007' / 'model.safetensors', 'rb').read() == f.read()
    assert open(tmp_path / 'bucket' / 'exp' / 'latest').read() == 'ckpt_0000007'
    # a damaged newest checkpoint is skipped for the one before, as locally
    with open(tmp_path / 'bucket' / 'exp' / 'ckpt_0000007' / 'model.safetensors', 'r+b') as f:
        f.write(b'\0\0\0\0')
    got = remote.download_latest(url, str(tmp_path / 'new'))
    assert got == str(tmp_path / 'new' / 'ckpt_0000003') and checkpoint.damage(got) is None


# ---------------------------------------------------------------- what a bucket holds is hostile

@pytest.fixture
def s3_env(s3, monkeypatch):
    """The server's credentials in this process's environment, for remote.py called here."""
    for name, value in s3[1].items():
        monkeypatch.setenv(name, value)
    return s3


def put(s3, prefix, objects):
    """{name: bytes} written under prefix in bucket runs, straight through boto3."""
    client = boto3.client('s3', **s3server.client_args(s3[1]))
    for name, body in objects.items():
        client.put_object(Bucket='runs', Key=prefix + name, Body=body)
    keys = {o['Key'] for o in client.list_objects_v2(Bucket='runs', Prefix=prefix)['Contents']}
    assert {prefix + name for name in objects} <= keys  # kept verbatim, '..' and '//' too


def good_checkpoint(tmp_path, step):
    """{name: bytes} of an intact checkpoint, as a bucket holds it."""
    fake_checkpoint(tmp_path / 'made', step, size=1000)
    ckpt = tmp_path / 'made' / f'ckpt_{step:07d}'
    return {f'{ckpt.name}/{f}': (ckpt / f).read_bytes() for f in os.listdir(ckpt)}


def tree(root):
    """{path: (is a folder, size, mtime)} of everything under root."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            info = os.lstat(os.path.join(folder, name))
            size = 0 if name in dirs else info.st_size
            found[os.path.join(folder, name)] = (name in dirs, size, info.st_mtime_ns)
    return found


def in_thread(fn, *args, timeout=60):
    """fn(*args)'s result or exception; a hang (hashing /dev/zero) fails instead of waiting."""
    out = {}

    def run():
        try:
            out['result'] = fn(*args)
        except BaseException as e:
            out['error'] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn.__name__} still runs after {timeout}s"
    if 'error' in out:
        raise out['error']
    return out['result']


def escapes(home):
    """Keys under a URL that, joined unchecked onto out_dir (home/project/out), lead out of it."""
    evil = b'print("evil")'
    zero = json.dumps({'/dev/zero': [1 << 40, '0' * 64], 'model.safetensors': [1, '0' * 64]})
    absolute = json.dumps({f'{home}/evil.py': [len(evil), '0' * 64]})
    return {
        'dots': {'ckpt_0000010/../../evil.py': evil, 'ckpt_0000010/manifest.json': b'{}'},
        'empty part': {'/manifest.json': b'{}', '/evil.py': evil},
        'parent as checkpoint': {'../manifest.json': b'{}', '../evil.py': evil},
        'absolute': {f'ckpt_0000010/{home}/evil.py': evil, 'ckpt_0000010/manifest.json': absolute},
        'dev zero': {'ckpt_0000010/manifest.json': zero, 'ckpt_0000010/model.safetensors': b'x'},
    }


@pytest.mark.parametrize('case', ['dots', 'empty part', 'parent as checkpoint', 'absolute',
                                  'dev zero'])
@pytest.mark.parametrize('older', [False, True], ids=['alone', 'beside an intact one'])
def test_hostile_keys_change_nothing_outside_out_dir_and_end_in_one_line(s3_env, tmp_path, capsys,
                                                                        case, older):
    """Keys with '..', an empty part, a '..' checkpoint, an absolute path, and a manifest naming
    /dev/zero: nothing outside out_dir is created, changed or deleted (out_dir's own files
    neither), and the download ends in one line or falls back to the intact older checkpoint."""
    home = tmp_path / 'home'
    out = home / 'project' / 'out'
    for path, body in [(home / 'project' / 'tiktoken.py', b'# the project'),
                       (home / 'data' / 'corpus.txt', b'the user\'s files'),
                       (out / 'notes.txt', b'a note kept in out_dir')]:
        os.makedirs(path.parent, exist_ok=True)
        path.write_bytes(body)
    prefix = f"hostile-{case.replace(' ', '-')}-{older}/"
    put(s3_env, prefix, {**escapes(home)[case], **(good_checkpoint(tmp_path, 3) if older else {})})
    before = tree(home)
    try:
        got = in_thread(remote.download_latest, f's3://runs/{prefix}', str(out))
        ended = None
    except SystemExit as e:
        got, ended = None, str(e)
    after = tree(home)
    changed = [p for p in before if p != str(out) and after.get(p) != before[p]]
    assert not changed, f"changed or deleted: {changed}"
    created = [p for p in after if p not in before and not p.startswith(str(out) + os.sep)]
    assert not created, f"created outside out_dir: {created}"
    assert sorted(os.listdir(out)) == (['ckpt_0000003', 'notes.txt'] if older else ['notes.txt'])
    err = capsys.readouterr().err
    assert all(line.startswith('warning: ') for line in err.splitlines()), err
    assert ('warning: skipping' in err) == (case != 'dev zero')  # stray keys are named once
    if older:
        assert got == str(out / 'ckpt_0000003') and checkpoint.damage(got) is None
    else:
        assert ended == f"error: no complete checkpoint under s3://runs/{prefix.rstrip('/')}; " \
                        "train first, or set --init_from=scratch"


def test_a_manifest_must_list_exactly_the_files_there(tmp_path):
    """An empty manifest, a list, one naming a missing file, one naming fewer files than there
    are, one naming /dev/zero, one with a malformed entry, and a checkpoint file that is a link
    (to /dev/zero, or to its neighbour): each is damage (never intact, never a traceback, never a
    hang), and the newest intact checkpoint is the one before."""
    fake_checkpoint(tmp_path, 1, size=100)
    fake_checkpoint(tmp_path, 2, size=100)
    ckpt = tmp_path / 'ckpt_0000002'
    true = json.loads((ckpt / 'manifest.json').read_text())
    assert checkpoint.damage(str(ckpt)) is None
    zero = dict(true, **{'/dev/zero': [1 << 40, '0' * 64]})
    lies = {'empty': {}, 'a list': [[n, v] for n, v in true.items()],
            'a missing file': dict(true, **{'extra.bin': [3, '0' * 64]}),
            'fewer files': {n: v for n, v in true.items() if n != 'train_state.pt'},
            '/dev/zero': zero, 'a malformed entry': dict(true, **{'model.safetensors': 'big'})}
    for what, manifest in lies.items():
        (ckpt / 'manifest.json').write_text(json.dumps(manifest))
        problem = in_thread(checkpoint.damage, str(ckpt))
        assert isinstance(problem, str) and '\n' not in problem, what
        assert checkpoint.latest(str(tmp_path), warn=False).endswith('ckpt_0000001'), what
    links = [('/dev/zero', [1 << 40, '0' * 64], "'model.safetensors' leads out of"),
             ('train_state.pt', true['train_state.pt'], 'model.safetensors is damaged (not a file')]
    for target, recorded, said in links:  # a file of the checkpoint that is a link: out, or in
        os.remove(ckpt / 'model.safetensors')
        os.symlink(target, ckpt / 'model.safetensors')
        manifest = dict(true, **{'model.safetensors': recorded})
        (ckpt / 'manifest.json').write_text(json.dumps(manifest))
        assert said in in_thread(checkpoint.damage, str(ckpt))


def test_a_download_falls_back_past_lying_manifests(s3_env, tmp_path, capsys):
    """Newer checkpoints whose manifests are {}, name a missing file, or are a list: each skipped
    with one warning line for the intact one before; with none intact, one error line."""
    good = good_checkpoint(tmp_path, 3)
    lies = {'ckpt_0000005/manifest.json': b'{}', 'ckpt_0000005/model.safetensors': b'x',
            'ckpt_0000007/manifest.json': json.dumps({'model.safetensors': [1, '0' * 64]}).encode(),
            'ckpt_0000009/manifest.json': b'[["model.safetensors", [1, "00"]]]',
            'ckpt_0000009/model.safetensors': b'x'}
    put(s3_env, 'lies/', {**good, **lies})
    got = remote.download_latest('s3://runs/lies', str(tmp_path / 'out'))
    assert got == str(tmp_path / 'out' / 'ckpt_0000003') and checkpoint.damage(got) is None
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(' is damaged')[0] for w in warnings] == [
        f'warning: s3://runs/lies/ckpt_000000{i}' for i in (9, 7, 5)]
    put(s3_env, 'only-lies/', lies)
    ended = r'^error: no complete checkpoint under s3://runs/only-lies;'
    with pytest.raises(SystemExit, match=ended):
        remote.download_latest('s3://runs/only-lies', str(tmp_path / 'other'))
    assert os.listdir(tmp_path / 'other') == []


def test_an_uploader_whose_url_another_run_took_deletes_nothing_and_warns_once(s3_env, tmp_path,
                                                                              capsys):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path / 'run', step, size=1000)
    uploader = remote.Uploader('s3://runs/taken', 'mine', retries=0)
    uploader.submit(str(tmp_path / 'run'), 1, 1)
    uploader.wait()
    put(s3_env, 'taken/', {'owner': b'theirs'})  # another run took the URL meanwhile
    theirs = remote_files(s3_env, 'taken/')
    shutil.rmtree(tmp_path / 'run' / 'ckpt_0000001')  # an upload would now delete it remotely
    uploader.submit(str(tmp_path / 'run'), 2, 2)
    uploader.wait()
    uploader.submit(str(tmp_path / 'run'), 3, 3)
    uploader.close()
    err = capsys.readouterr().err
    assert err == ("warning: s3://runs/taken belongs to another run now; this run uploads nothing "
                   "more there and deletes nothing\n")
    files = remote_files(s3_env, 'taken/')
    assert {k: files[k] for k in theirs} == theirs  # every object of theirs, byte for byte
    assert 'ckpt_0000003/manifest.json' not in files


def test_a_url_is_claimed_once_and_a_second_run_is_refused_before_its_first_upload_too(s3_env):
    """An empty URL is claimed by the first run that opens it. A second run is refused while
    the first has uploaded nothing yet (it would take the prefix over) and once it has; the
    owner stays. Deleting the owner of a run that never uploaded frees the URL."""
    remote.open_store('s3://runs/claim', 'first')
    assert remote_files(s3_env, 'claim/') == {'owner': b'first'}
    with pytest.raises(SystemExit, match='error: s3://runs/claim belongs to another run'):
        remote.open_store('s3://runs/claim', 'second')
    put(s3_env, 'claim/', {'ckpt_0000001/manifest.json': b'{}'})
    with pytest.raises(SystemExit, match='error: s3://runs/claim belongs to another run'):
        remote.open_store('s3://runs/claim', 'third')
    assert remote_files(s3_env, 'claim/')['owner'] == b'first'
    client = boto3.client('s3', **s3server.client_args(s3_env[1]))
    for key in ('claim/ckpt_0000001/manifest.json', 'claim/owner'):
        client.delete_object(Bucket='runs', Key=key)
    remote.open_store('s3://runs/claim', 'fourth')
    assert remote_files(s3_env, 'claim/') == {'owner': b'fourth'}


def test_a_prefix_inside_a_checkpoint_folder_is_refused_and_that_checkpoint_untouched(s3_env):
    theirs = {'ckpt_0000002/manifest.json': b'{}'}
    put(s3_env, 'theirs/', theirs)
    for url in ('s3://runs/theirs/ckpt_0000002', 's3://runs/theirs/ckpt_0000002/sub/'):
        with pytest.raises(SystemExit) as e:
            remote.open_store(url, 'mine')
        assert str(e.value) == (f"error: {url} lies inside checkpoint folder ckpt_0000002; upload to a "
                                "prefix of the run's own")
    assert remote_files(s3_env, 'theirs/') == theirs


@pytest.mark.parametrize('kind', ['s3', 'file'])
def test_runs_that_claim_one_url_at_the_same_moment_leave_one_owner(s3_env, tmp_path, kind):
    """Eight runs open one empty URL at once: exactly one owns it, the others are refused; the
    claim is a create-if-absent (S3's If-None-Match, an exclusive open), never read-then-write."""
    url = 's3://runs/race' if kind == 's3' else f'file://{tmp_path}/race'
    ready = threading.Barrier(8)

    def claim(run_id):
        ready.wait()
        try:
            remote.open_store(url, run_id)
            return run_id
        except SystemExit as e:
            assert str(e).startswith(f'error: {url} belongs to another run')
    threads, won = [], []
    for i in range(8):
        threads.append(threading.Thread(target=lambda i=i: won.append(claim(f'run{i}'))))
        threads[-1].start()
    for thread in threads:
        thread.join(60)
    winners = [w for w in won if w]
    assert len(won) == 8 and len(winners) == 1
    store = remote.S3(url) if kind == 's3' else remote.Fsspec(url)
    store.create_text('late', 'owner')  # the claim is a write that never replaces one
    owner = remote_files(s3_env, 'race/')['owner'] if kind == 's3' else (tmp_path / 'race' / 'owner').read_bytes()
    assert owner == winners[0].encode()


def test_a_server_a_byte_a_second_ends_each_operation_within_the_limit_in_one_line(s3_env, tmp_path, capsys,
                                                                                      monkeypatch):
    """Behind a proxy that passes a byte a second (every per-read timeout is happy), opening the
    URL ends in one line at the limit, and an upload in one warning, training going on."""
    proxy, env = s3_env
    monkeypatch.setenv('NANOBITNET_REMOTE_TIMEOUT', '3')
    uploader = remote.Uploader('s3://runs/slow', 'slow-run', retries=1, backoff=0.05)
    fake_checkpoint(tmp_path, 1, size=1000)
    try:
        proxy.throttle(1)
        start = time.time()
        uploader.submit(str(tmp_path), 1, 1)
        uploader.wait()
        assert time.time() - start < 8  # two tries of 3 s each
        assert capsys.readouterr().err == (
            "warning: uploading ckpt_0000001 to s3://runs/slow failed after 2 tries (TimeoutError: "
            "s3://runs/slow did not answer within 3s; check it, or set NANOBITNET_REMOTE_TIMEOUT=SECONDS "
            "higher); training goes on, the next checkpoint tries again\n")
        start = time.time()
        with pytest.raises(SystemExit) as e:
            remote.open_store('s3://runs/slow2', 'another-run')
        assert time.time() - start < 5
        assert str(e.value) == ("error: cannot use s3://runs/slow2 (TimeoutError: s3://runs/slow2 did not answer "
                                "within 3s; check it, or set NANOBITNET_REMOTE_TIMEOUT=SECONDS higher); check the "
                                "bucket, the path and the credentials")
    finally:
        proxy.throttle(None)
    uploader.close()


@pytest.mark.slow
def test_a_run_owns_its_upload_url_and_another_is_refused_before_training(s3, tmp_path):
    """Run A uploads with keep_last=1; run B (from scratch) under the same URL is refused in one
    line at its start, and every object of A's is still there byte for byte; A resumed uploads
    and deletes its own old checkpoints again."""
    proxy, env = s3
    url = 's3://runs/shared'
    a = train(env, f'--out_dir={tmp_path / "a"}', f'--upload_to={url}', '--ckpt.keep_last=1',
              '--max_steps=4')
    assert a.returncode == 0, a.stderr
    first = remote_files(s3, 'shared/')
    assert 'ckpt_0000004/manifest.json' in first and len(first['owner']) == 32
    b = train(env, f'--out_dir={tmp_path / "b"}', f'--upload_to={url}', '--max_steps=4')
    assert b.returncode == 1 and b.stderr == (f"error: {url} belongs to another run; set "
                                              f"another --upload_to, or resume that run with "
                                              f"--init_from={url} (a run that never uploaded: "
                                              f"delete {url}/owner)\n")
    assert not os.path.exists(tmp_path / 'b' / 'log.jsonl')
    assert remote_files(s3, 'shared/') == first
    again = train(env, f'--out_dir={tmp_path / "a"}', '--init_from=resume', f'--upload_to={url}',
                  '--ckpt.keep_last=1', '--max_steps=6')
    assert again.returncode == 0, again.stderr
    assert f"uploads done: {url}/ckpt_0000006" in again.stdout
    files = remote_files(s3, 'shared/')
    local = sorted(os.path.basename(c) for c in checkpoint.checkpoints(tmp_path / 'a'))
    assert sorted({k.split('/')[0] for k in files if k.startswith('ckpt_')}) == local
    assert files['owner'] == first['owner'] and files['latest'] == b'ckpt_0000006'


def test_init_from_a_url_into_an_out_dir_with_a_checkpoint_stops_before_downloading(s3, tmp_path):
    put(s3, 'elsewhere/', good_checkpoint(tmp_path, 3))
    out = tmp_path / 'out'
    fake_checkpoint(out, 7, size=1000)
    held = tree(out)
    r = train(s3[1], f'--out_dir={out}', '--init_from=s3://runs/elsewhere')
    assert r.returncode == 1 and r.stderr == (f"error: {out} already holds ckpt_0000007; "
                                              "--init_from=URL starts in an empty out_dir: set a "
                                              "new --out_dir, or --init_from=resume\n")
    assert tree(out) == held  # nothing downloaded, nothing changed


def test_a_log_cut_off_mid_line_loses_that_line_with_a_warning(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    checkpoint.truncate_log(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    warning = f"warning: {path}: line 3 is cut off or no record; dropping it\n"
    assert capsys.readouterr().err == warning


@pytest.mark.slow
def test_a_resume_after_a_crash_mid_log_line_runs_on(tmp_path):
    out = tmp_path / 'out'
    first = train({}, f'--out_dir={out}', '--max_steps=2')
    assert first.returncode == 0, first.stderr
    with open(out / 'log.jsonl', 'a') as f:
        f.write('{"step": 3, "loss": 5.1, "grad_n')  # the crash came mid-write
    again = train({}, f'--out_dir={out}', '--init_from=resume', '--max_steps=3')
    assert again.returncode == 0, again.stderr
    warning = f"warning: {out / 'log.jsonl'}: line 3 is cut off or no record; dropping it"
    assert warning in again.stderr
    assert 'Traceback' not in again.stderr
    assert [r['step'] for r in log(out)] == [1, 2, 3]


def test_a_stored_checkpoint_is_compared_with_its_manifest_before_its_files_are_read(s3_env, tmp_path,
                                                                                    capsys, monkeypatch):
    """A newer checkpoint whose model.safetensors is 8 MB where its manifest lists 100 B, and one whose
    manifest is 2 MiB: each skipped with one warning after reading no more than its manifest (the
    bucket's sizes are compared first); the intact one before is downloaded."""
    good = good_checkpoint(tmp_path, 3)
    manifest = json.dumps({'model.safetensors': [100, '0' * 64]}).encode()
    stored = {'ckpt_0000005/manifest.json': manifest, 'ckpt_0000005/model.safetensors': b'x' * (8 << 20),
              'ckpt_0000007/manifest.json': b' ' * (2 << 20), 'ckpt_0000007/model.safetensors': b'x'}
    put(s3_env, 'sizes/', {**good, **stored})
    fetched = []
    get = remote.S3.get
    monkeypatch.setattr(remote.S3, 'get', lambda store, name, path: fetched.append(name) or get(store, name, path))
    got = remote.download_latest('s3://runs/sizes', str(tmp_path / 'out'))
    assert got == str(tmp_path / 'out' / 'ckpt_0000003')
    assert 'ckpt_0000005/model.safetensors' not in fetched and not any(n.startswith('ckpt_0000007') for n in fetched)
    warnings = capsys.readouterr().err.splitlines()
    assert 'model.safetensors is not in its manifest at its stored size (8,388,608 bytes)' in warnings[1]
    assert 'its manifest is over 1,048,576 bytes' in warnings[0]


def test_a_password_in_the_object_stores_endpoint_url_is_never_printed(s3_env, monkeypatch):
    """AWS_ENDPOINT_URL=http://user:PASSWORD@host where nothing answers: the one-line error names the
    endpoint with *** for the password (boto3 puts the URL in its message)."""
    monkeypatch.setenv('AWS_ENDPOINT_URL', 'http://user:pa55-w0rd-x@127.0.0.1:9/')
    monkeypatch.setenv('NANOBITNET_REMOTE_TIMEOUT', '20')
    with pytest.raises(SystemExit) as refused:
        remote.open_store('s3://runs/x', 'me')
    message = str(refused.value)
    assert message.startswith('error: cannot use s3://runs/x') and '\n' not in message
    assert 'pa55-w0rd-x' not in message and 'user:***@127.0.0.1' in message, message
