"""hub.py's downloads against a real HTTP server on 127.0.0.1 that plays the Hugging Face hub:
resolve URLs, LFS redirects with X-Linked-Etag, Range requests, gated files; and against hostile
ones: an index whose names climb out of the cache, servers that should not see the token, a
server that trickles. No mocks."""
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import data
import hub
import tokenizer
from conftest import Hub, blob

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
                                '--arch.n_layer=1', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64',
                                '--sample.tokens=4', '--wandb_project=nanobitnet', f'--out_dir={out}'], cwd=ROOT,
                               env={**env, 'PYTHONPATH': f'{fake}:{ROOT}', 'WANDB_FILE': str(tmp_path / 'wandb.json')},
                               capture_output=True, text=True, timeout=300))
    assert runs[-1].returncode == 0, runs[-1].stderr
    assert json.load(open(tmp_path / 'wandb.json'))['max_steps'] == 2  # the stand-in saw the config
    files = [out / 'log.jsonl', tmp_path / 'wandb.json', *out.glob('ckpt_*/*')]
    seen = [r.stdout + r.stderr for r in runs] + [read(f).decode('latin-1') for f in files]
    assert not [s for s in seen if token in s]


# -----------------------------------------------------------------------------
# hostile hubs and servers

class RealHubPaths(Hub):
    """The test hub reading paths as the real one does: the query string names no file, so
    '.../resolve/main/q?/-' serves the file 'q'."""

    def do_GET(self):
        self.path = self.path.split('?')[0]
        super().do_GET()


def tree(root, skip):
    """Every file and folder under root except those under skip: path -> (size, mtime)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if not path.startswith(skip):
                st = os.lstat(path)
                found[path] = (st.st_size, st.st_mtime_ns)
    return found


def attack(folder, target):
    """The shard names of the reported attack: a folder named 'q?' made in the repo's folder, then
    a name that climbs from it to target. Both fetch the repo's file 'q', since '?' starts the query."""
    return ['q?/-', 'q?/' + os.path.relpath(target, os.path.join(folder, 'q?'))]


@pytest.mark.parametrize('shards', ['attack', 'dots', 'query', 'not str', 'no map'])
def test_a_hub_index_writes_nothing_outside_its_repo(hub_server, tmp_path, shards):
    hub_server.RequestHandlerClass = RealHubPaths
    folder = os.path.join(tmp_path, 'cache', 'models', 'org', 'evil', 'main')
    pth = os.path.join(tmp_path, 'home', '.local', 'lib', 'python3.11', 'site-packages', 'x.pth')
    names = {'attack': attack(folder, pth), 'dots': [os.path.relpath(pth, folder)], 'query': ['q?x'],
             'not str': [5], 'no map': None}[shards]
    index = {'weight_map': {f't{i}': n for i, n in enumerate(names)} if names else ['q']}
    for name, body in (('config.json', b'{}'), ('model.safetensors.index.json', json.dumps(index).encode()),
                       ('q', b'import os; os.system("echo owned")\n')):
        hub_server.files[f'org/evil/{name}'] = {'body': body}
    (tmp_path / 'home').mkdir()
    before = tree(str(tmp_path), str(tmp_path / 'cache'))
    with pytest.raises((hub.DownloadError, ValueError)) as e:
        hub.resolve_model('org/evil')
    msg = str(e.value)
    assert msg.startswith('refusing hub repo org/evil: ') and 'not a plain file name' in msg and '\n' not in msg
    assert tree(str(tmp_path), str(tmp_path / 'cache')) == before  # names, sizes, times: untouched
    assert all(folder.startswith(p + os.sep) for p in tree(str(tmp_path / 'cache'), folder))  # only its parents
    assert not list(tmp_path.rglob('*.pth')) and not os.path.exists(os.path.join(folder, '.complete'))
    assert [p for p, _, _ in hub_server.log] == ['/org/evil/resolve/main/config.json',
                                                '/org/evil/resolve/main/model.safetensors.index.json']


def test_repo_ids_revisions_and_file_names_are_refused_before_any_request(hub_server, tmp_path):
    for bad in (lambda: hub.resolve_model('org/model', revision='../../up'),
                lambda: hub.hub_download('org/..', 'config.json'),
                lambda: hub.hub_download('org', 'config.json'),
                lambda: hub.fetch('hf://datasets/org/data/../../../../up.txt'),
                lambda: hub.fetch('hf://datasets/org/data@../x.txt'),
                lambda: hub.fetch('hf://datasets/org/data/dir/a?b')):
        with pytest.raises(ValueError, match='is not a plain file name; refusing it'):
            bad()
    assert not hub_server.log and not os.path.exists(tmp_path / 'cache') and os.listdir(tmp_path) == []
    url, dest = hub.hub_file('org/model', 'dir/a b%.txt', 'dataset', 'v1')  # quoted, not refused
    assert url.endswith('/datasets/org/model/resolve/v1/dir/a%20b%25.txt')
    assert dest == os.path.join(tmp_path, 'cache', 'datasets', 'org', 'model', 'v1', 'dir', 'a b%.txt')


class Site(http.server.BaseHTTPRequestHandler):
    """A plain web server on 127.0.0.1: serves server.pages {path: body}, redirects server.moved
    {path: URL}, and sends the bodies of server.slow {path: (body, seconds per byte or None for
    none at all)} slowly, for at most 30 s, and the status line and headers of the paths in
    server.slow_headers a byte a second; logs each request's path and Authorization."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        site = self.server
        site.log.append((self.path, self.headers.get('Authorization')))
        if self.path in site.moved:
            self.send_response(302)
            self.send_header('Location', site.moved[self.path])
            self.send_header('Content-Length', '0')
            return self.end_headers()
        body, pace = site.slow.get(self.path, (site.pages.get(self.path, b''), 0))
        if self.path in site.slow_headers:
            return self.trickle(b'HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello')
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        try:
            if self.path not in site.slow:
                return self.wfile.write(body)
            for i in range(30):  # a bounded stall: an unfixed client fails too, late
                time.sleep(pace or 1)
                if pace:
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def trickle(self, reply):
        try:
            for byte in reply[:30]:  # bounded: an unfixed client fails too, late
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(1)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def sites():
    """start() -> a new Site server on 127.0.0.1; all are shut down after the test."""
    started = []

    def start():
        server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Site)
        server.pages, server.moved, server.slow, server.log = {}, {}, {}, []
        server.slow_headers = set()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server
    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_the_token_goes_only_to_the_hub_host_and_port(hub_server, sites, monkeypatch):
    monkeypatch.setenv('HF_TOKEN', 'secret')
    hub_server.files['org/data/a.txt'] = {'body': b'from the hub'}
    hub_server.files['org/data/b.txt'] = {'body': b'from the hub, by another name'}
    other = sites()
    other.pages['/c.txt'] = b'from another port'
    port = hub_server.server_port
    assert read(hub.fetch(f'http://127.0.0.1:{port}/org/data/resolve/main/a.txt')) == b'from the hub'
    assert read(hub.fetch(f'http://localhost:{port}/org/data/resolve/main/b.txt')) == b'from the hub, by another name'
    assert read(hub.fetch(f'http://127.0.0.1:{other.server_port}/c.txt')) == b'from another port'
    assert [auth for _, _, auth in hub_server.log] == ['Bearer secret', None]  # 'localhost' is another host name
    assert other.log == [('/c.txt', None)]

    # the hub redirects a file to a server on another port: the redirect carries no token
    monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{(hub_site := sites()).server_port}')
    hub_site.moved['/org/model/resolve/main/w.bin'] = f'http://127.0.0.1:{other.server_port}/w.bin'
    other.pages['/w.bin'] = blob(5000)
    assert read(hub.hub_download('org/model', 'w.bin')) == blob(5000)
    assert hub_site.log == [('/org/model/resolve/main/w.bin', 'Bearer secret')] and other.log[-1] == ('/w.bin', None)


@pytest.mark.parametrize('endpoint, url, sent', [
    ('https://huggingface.co', 'https://huggingface.co/org/m/resolve/main/x', True),
    ('https://huggingface.co', 'http://huggingface.co/x', False),  # plain http
    ('https://huggingface.co', 'https://huggingface.co:8443/x', False),
    ('https://huggingface.co', 'https://huggingface.co.example.com/x', False),
    ('https://huggingface.co', 'https://huggingface.co@example.com/x', False),
    ('https://huggingface.co', 'https://example.com/?https://huggingface.co/x', False),
    ('http://mirror.example.com', 'http://mirror.example.com/x', False),  # plain http off this machine
    ('http://[::1]:8080', 'http://[::1]:8080/x', True),
    ('http://127.0.0.1:8080', 'http://127.0.0.1:8081/x', False),
])
def test_which_urls_get_the_token(endpoint, url, sent, monkeypatch):
    monkeypatch.setenv('HF_ENDPOINT', endpoint)
    monkeypatch.setenv('HF_TOKEN', 'secret')
    assert hub.token_header(url) == ({'Authorization': 'Bearer secret'} if sent else {})
    monkeypatch.delenv('HF_TOKEN')
    assert hub.token_header(url) == {}


@pytest.mark.parametrize('pace', [1.0, None], ids=['a byte a second', 'silent'])
def test_a_stalled_transfer_fails_within_the_deadline(hub_server, sites, monkeypatch, pace):
    monkeypatch.setattr(hub, 'STALL_BYTES', 1000)
    monkeypatch.setattr(hub, 'STALL_SECONDS', 2.0)
    slow = sites()
    slow.slow['/big.bin'] = (blob(100_000), pace)
    start = time.time()
    with pytest.raises(hub.DownloadError) as e:
        hub.fetch(f'http://127.0.0.1:{slow.server_port}/big.bin')
    took = time.time() - start
    msg = str(e.value)
    assert re.fullmatch(rf'cannot download http://127.0.0.1:{slow.server_port}/big.bin \(ReadTimeout(Error)?\); .*', msg)
    assert len(slow.log) == 3  # the normal tries, each ended by the deadline
    assert took < 20, took  # each try about 2-3 s, and 0 + 1 + 2 s between them; unchecked, 30 s a try


def test_headers_a_byte_a_second_end_within_the_overall_limit_in_one_line(sites, monkeypatch):
    monkeypatch.setenv('NANOBITNET_HUB_TIMEOUT', '3')
    slow = sites()
    slow.slow_headers.add('/w.bin')
    url = f'http://127.0.0.1:{slow.server_port}/w.bin'
    start = time.time()
    with pytest.raises(hub.DownloadError) as e:
        hub.fetch(url)
    assert time.time() - start < 6  # per-read timeouts alone: the whole 30 s trickle
    assert str(e.value) == (f"{url} did not answer within 3s; check it, or set NANOBITNET_HUB_TIMEOUT=SECONDS "
                            "higher, or download it yourself and pass its local path")
    assert len(slow.log) == 1  # not tried again: a server that slow stays that slow


@pytest.mark.parametrize('value', ['0', '-1', 'inf', 'nan', 'soon'])
def test_a_time_limit_that_is_no_positive_number_is_one_line(sites, monkeypatch, value):
    monkeypatch.setenv('NANOBITNET_HUB_TIMEOUT', value)
    with pytest.raises(ValueError, match=f"^NANOBITNET_HUB_TIMEOUT='{value}' is not a number of seconds above 0; fix it$"):
        hub.fetch(f'http://127.0.0.1:{sites().server_port}/w.bin')
