"""remote.py against a real S3-compatible server (moto's, on 127.0.0.1, authentication on) through
boto3: every checkpoint uploaded byte for byte, a resume from storage equal to the uninterrupted
run, a cut upload never complete, bad buckets and credentials caught before training, and the
credentials in no output or file."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import boto3
import pytest

import checkpoint
import remote
import s3server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--intermediate_size=64', '--batch_size=4',
        '--block_size=32', '--eval_iters=2', '--log_interval=1', '--warmup_steps=2', '--eval_interval=2',
        '--sample_tokens=0', '--max_steps=8']


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
    first = train(env, f'--out_dir={tmp_path / "a"}', '--upload_to=s3://runs/exp', '--stop_after=4', '--keep_last=1')
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
        uploader = remote.Uploader('s3://runs/cut', retries=2, backoff=0.05)
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
    uploader = remote.Uploader(url)
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
