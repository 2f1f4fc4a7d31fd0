"""hub.py's downloads against a real HTTP server on 127.0.0.1 that plays the Hugging Face hub:
resolve URLs, LFS redirects with X-Linked-Etag, Range requests, gated files. No mocks."""
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import data
import hub
import tokenizer
from conftest import blob

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(path, 'rb') as f:
        return f.read()


def test_redirect_checksum_and_cache(hub_server):
    body = blob(3_000_000)
    hub_server.files['org/model/model.safetensors'] = {'body': body, 'lfs': True}
    path = hub.hub_download('org/model', 'model.safetensors')
    assert read(path) == body and not os.path.exists(path + '.part')
    assert [p for p, _, _ in hub_server.log] == ['/org/model/resolve/main/model.safetensors', '/cdn/org/model/model.safetensors']
    assert hub.hub_download('org/model', 'model.safetensors') == path and len(hub_server.log) == 2  # cached: no request


def test_dataset_files_and_hf_names(hub_server, tmp_path):
    hub_server.files['datasets/org/stories/dir/valid.txt'] = {'body': b'Once upon a time.'}
    assert read(hub.fetch('hf://datasets/org/stories/dir/valid.txt')) == b'Once upon a time.'
    assert read(hub.fetch('hf://datasets/org/stories@v2/dir/valid.txt', str(tmp_path / 'here'))) == b'Once upon a time.'
    assert os.path.exists(tmp_path / 'here' / 'valid.txt')
    assert [p for p, _, _ in hub_server.log] == ['/datasets/org/stories/resolve/main/dir/valid.txt',
                                          '/datasets/org/stories/resolve/v2/dir/valid.txt']


def test_cut_transfer_resumes_with_range(hub_server):
    body = blob(2_000_000, seed=1)
    hub_server.files['org/model/big.bin'] = {'body': body, 'lfs': True}
    hub_server.cut.add('/cdn/org/model/big.bin')
    assert read(hub.hub_download('org/model', 'big.bin')) == body
    ranges = [r for p, r, _ in hub_server.log if p.startswith('/cdn/')]
    assert ranges[0] is None and ranges[1] is not None
    resumed_at = int(re.fullmatch(r'bytes=(\d+)-', ranges[1])[1])
    assert 0 < resumed_at < len(body)


def test_404_and_401_say_what_to_do(hub_server, monkeypatch):
    hub_server.files['org/gated/config.json'] = {'body': b'{}', 'gated': True}
    with pytest.raises(hub.DownloadError) as e:
        hub.hub_download('org/model', 'missing.bin')
    msg = str(e.value)
    assert e.value.status == 404 and 'HTTP 404, not found' in msg and '/org/model/resolve/main/missing.bin' in msg
    assert 'local path' in msg and '\n' not in msg
    with pytest.raises(hub.DownloadError) as e:
        hub.hub_download('org/gated', 'config.json')
    assert e.value.status == 401 and 'set HF_TOKEN' in str(e.value) and '\n' not in str(e.value)
    monkeypatch.setenv('HF_TOKEN', 'secret')
    assert read(hub.hub_download('org/gated', 'config.json')) == b'{}'
    assert hub_server.log[-1][2] == 'Bearer secret'


def test_checksum_mismatch_leaves_no_file(hub_server):
    hub_server.files['org/model/model.safetensors'] = {'body': blob(100_000), 'lfs': True, 'sha': 'ab' * 32}
    dest = os.path.join(hub.cache_dir(), 'models', 'org/model', 'main', 'model.safetensors')
    with pytest.raises(hub.DownloadError, match="sha256 .* is not the hub's abababab"):
        hub.hub_download('org/model', 'model.safetensors')
    assert not os.path.exists(dest) and not os.path.exists(dest + '.part')


def test_unreachable_and_offline(hub_server, monkeypatch):
    monkeypatch.setenv('HF_ENDPOINT', 'http://127.0.0.1:9')  # nothing listens on the discard port
    with pytest.raises(hub.DownloadError) as e:
        hub.hub_download('org/model', 'config.json')
    assert 'cannot download http://127.0.0.1:9/org/model/resolve/main/config.json' in str(e.value)
    assert 'pass its local path' in str(e.value) and '\n' not in str(e.value)
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    with pytest.raises(hub.DownloadError, match='HF_HUB_OFFLINE is set'):
        hub.hub_download('org/model', 'config.json')


RANK_SCRIPT = """
import hashlib, sys
sys.path.insert(0, {root!r})
import hub
path = hub.hub_download('org/model', 'model.safetensors')
print(hashlib.sha256(open(path, 'rb').read()).hexdigest())
"""


def test_two_local_ranks_one_downloads(hub_server, tmp_path):
    body = blob(1_000_000, seed=2)
    hub_server.files['org/model/model.safetensors'] = {'body': body, 'lfs': True}
    hub_server.delay = 1.0  # rank 1 must really wait for rank 0
    script = tmp_path / 'rank.py'
    script.write_text(RANK_SCRIPT.format(root=ROOT))
    procs = []
    for rank in (1, 0):
        procs.append(subprocess.Popen([sys.executable, str(script)], env={**os.environ, 'LOCAL_RANK': str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(0.3)
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [o.strip() for o, _ in outs] == [hashlib.sha256(body).hexdigest()] * 2
    assert [p for p, _, _ in hub_server.log].count('/org/model/resolve/main/model.safetensors') == 1


def test_resolve_model_single_and_sharded(hub_server, tmp_path):
    index = {'weight_map': {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}}
    files = {'config.json': b'{"model_type": "llama"}', 'tokenizer.json': b'{}',
             'model.safetensors.index.json': json.dumps(index).encode(),
             'model-00001-of-00002.safetensors': blob(1000, 3), 'model-00002-of-00002.safetensors': blob(1000, 4)}
    for name, body in files.items():
        hub_server.files[f'org/sharded/{name}'] = {'body': body, 'lfs': name.endswith('.safetensors')}
    hub_server.files['org/single/config.json'] = {'body': b'{}'}
    hub_server.files['org/single/model.safetensors'] = {'body': blob(500), 'lfs': True}
    folder = hub.resolve_model('org/sharded')
    assert all(read(os.path.join(folder, n)) == b for n, b in files.items())
    folder = hub.resolve_model('org/single')
    assert sorted(os.listdir(folder)) == ['.complete', 'config.json', 'model.safetensors']  # no tokenizer.json: fine
    assert hub.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match='neither a model directory nor a hub id'):
        hub.resolve_model('no/such/dir')


def test_setup_data_from_the_hub(hub_server, tmp_path):
    shard = tmp_path / 'fineweb_train_000001.bin'
    header = np.zeros(256, np.int32)
    header[:3] = 20240520, 1, 3000
    shard.write_bytes(header.tobytes() + np.arange(3000, dtype=np.uint16).tobytes())
    hub_server.files['datasets/org/fw/fineweb_train_000001.bin'] = {'body': shard.read_bytes(), 'lfs': True}
    hub_server.files['datasets/org/fw/fineweb_val_000000.bin'] = {'body': shard.read_bytes(), 'lfs': True}
    folder = data.setup_data(str(tmp_path / 'fw'), {'train': ['hf://datasets/org/fw/fineweb_train_000001.bin'],
                                                    'val': 'hf://datasets/org/fw/fineweb_val_000000.bin'}, 'gpt2', 'tokens')
    x = data.Loader(folder, 2, 32, split='val').next_batch()['x']
    assert x[0, 1] - x[0, 0] == 1 and sorted(os.listdir(folder))[0] == 'fineweb_train_000001.bin'

    hub_server.files['datasets/org/stories/train.txt'] = {'body': '<|endoftext|>\n'.join(['A story.'] * 300).encode(), 'lfs': True}
    hub_server.files['datasets/org/stories/valid.txt'] = {'body': b'The end.\n<|endoftext|>\nReally.'}
    folder = data.setup_data(str(tmp_path / 'st'), {'train': 'hf://datasets/org/stories/train.txt',
                                                    'val': 'hf://datasets/org/stories/valid.txt'}, 'bytes', 'text')
    val = data.read_shard(os.path.join(folder, 'val_000000.bin'))
    assert tokenizer.byte_encoding().decode(val.tolist()) == '<|endoftext|>The end.<|endoftext|>Really.'


def test_tokenizer_from_a_hub_model_id(hub_server):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(['hello world, hello there'] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=['<|endoftext|>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hub_server.files['org/tiny/tokenizer.json'] = {'body': tok.to_str().encode()}
    enc = tokenizer.get_tokenizer('org/tiny')
    assert enc.encode_ordinary('hello world') == tok.encode('hello world').ids and tokenizer.eos_id(enc) == 0


DOWNLOAD = """import sys, hub
try:
    hub.hub_download(sys.argv[1], sys.argv[2])
except hub.DownloadError as e:
    print(e, repr(e), file=sys.stderr)
    sys.exit(1)"""


def download_lines(hub_server, tty):
    """`hub.hub_download` of a 4 MB file at 300 KB/s in a child process, its stdout a pipe or a
    terminal (a pty): the progress lines it prints, split at carriage returns and newlines."""
    import pty
    hub_server.files['org/model/big.bin'] = {'body': blob(4_000_000, seed=3), 'lfs': True}
    hub_server.rate = 300_000
    read_fd, write_fd = pty.openpty() if tty else os.pipe()
    proc = subprocess.Popen([sys.executable, '-c', DOWNLOAD, 'org/model', 'big.bin'], cwd=ROOT, stdout=write_fd,
                            env={**os.environ, 'PYTHONPATH': ROOT})
    os.close(write_fd)
    out = b''
    while chunk := _read(read_fd):
        out += chunk
    assert proc.wait() == 0
    return [line for line in re.split(r'[\r\n]', out.decode()) if line.strip()], out.decode()


def _read(fd):
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # a pty's reader gets EIO once the child has closed it
        return b''


@pytest.mark.slow
@pytest.mark.parametrize('tty', [True, False])
def test_download_shows_progress(hub_server, tty):
    lines, raw = download_lines(hub_server, tty)
    done = [float(re.search(r': ([\d.]+) / 4\.0 MB', line)[1]) for line in lines]
    assert all(line.startswith('download big.bin: ') and 'MB/s' in line for line in lines), lines
    assert done == sorted(done) and done[-1] == 4.0  # growing byte counts, then the total
    if tty:  # rewritten in place, a few times a second
        assert len(lines) >= 10 and '\r' in raw and 'ETA' in lines[0]
    else:  # a line every 10 s and the last one: readable in a log, not thousands
        assert 2 <= len(lines) <= 4 and '\r' not in raw


@pytest.mark.slow
def test_the_token_never_reaches_a_log(hub_server, tmp_path):
    """HF_TOKEN goes out only as a header, and only to the hub's host: not after a redirect to
    another host, not into messages (a 401 included), log.jsonl, train_state.pt or W&B's config."""
    token = 'hf_' + os.urandom(12).hex()
    hub_server.files['org/gated/model.bin'] = {'body': blob(100_000), 'lfs': True, 'gated': True, 'token': token}
    hub_server.files['org/other/config.json'] = {'body': b'{}', 'gated': True, 'token': 'someone else'}
    hub_server.cdn_host = 'localhost'  # the hub is 127.0.0.1: the redirect goes to another host name
    env = {**os.environ, 'PYTHONPATH': ROOT, 'HF_TOKEN': token}
    runs = [subprocess.run([sys.executable, '-c', DOWNLOAD, repo, name], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120) for repo, name in (('org/gated', 'model.bin'), ('org/other', 'config.json'))]
    assert runs[0].returncode == 0 and runs[1].returncode == 1 and 'HTTP 401' in runs[1].stderr
    sent = {path: auth for path, _, auth in hub_server.log}
    assert sent['/org/gated/resolve/main/model.bin'] == f'Bearer {token}' and sent['/cdn/org/gated/model.bin'] is None
    fake = tmp_path / 'fake'  # a stand-in for wandb that writes what it is given to a file
    fake.mkdir()
    (fake / 'wandb.py').write_text("import json, os\ndef init(project, config):\n"
                                   "    json.dump(config, open(os.environ['WANDB_FILE'], 'w'))\n"
                                   "def log(rec, step):\n    pass\n")
    out = tmp_path / 'out'
    runs.append(subprocess.run([sys.executable, 'train.py', '--max_steps=2', '--eval_interval=2', '--eval_iters=1',
                                '--n_layer=1', '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--intermediate_size=64',
                                '--sample_tokens=4', '--wandb_log=True', f'--out_dir={out}'], cwd=ROOT,
                               env={**env, 'PYTHONPATH': f'{fake}:{ROOT}', 'WANDB_FILE': str(tmp_path / 'wandb.json')},
                               capture_output=True, text=True, timeout=300))
    assert runs[-1].returncode == 0, runs[-1].stderr
    assert json.load(open(tmp_path / 'wandb.json'))['max_steps'] == 2  # the stand-in saw the config
    files = [out / 'log.jsonl', tmp_path / 'wandb.json', *out.glob('ckpt_*/*')]
    seen = [r.stdout + r.stderr for r in runs] + [read(f).decode('latin-1') for f in files]
    assert not [s for s in seen if token in s]
