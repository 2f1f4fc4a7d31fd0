"""Shared by the tests: the project root on sys.path, a fake Hugging Face hub served over
real HTTP on 127.0.0.1 (HF_ENDPOINT points at it; no mocks), a small teacher checkpoint and two
prepared data sources for the training runs."""
import hashlib
import http.server
import os
import re
import sys
import threading
import time

# pytest.ini runs the tests on several workers (pytest-xdist): each takes its share of the
# cores, for itself and for the train.py and torchrun processes it starts (they inherit
# it), set before torch is imported. Two workers' torch threads spinning on the same two
# cores run several times slower than one thread each.
if 'PYTEST_XDIST_WORKER' in os.environ and 'OMP_NUM_THREADS' not in os.environ:
    share = (os.cpu_count() or 1) // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])
    os.environ['OMP_NUM_THREADS'] = str(max(1, share))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Hub(http.server.BaseHTTPRequestHandler):
    """GET /[datasets/]{repo}/resolve/{revision}/{file}: small files served directly, large
    ('lfs') ones redirected to /cdn/... with their sha256 in X-Linked-Etag, as the hub does (on
    hub.cdn_host, another host name for the same server, when set; throttled to hub.rate bytes/s)."""

    def log_message(self, *args):
        pass

    def send(self, code, body=b'', headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        hub = self.server
        hub.log.append((self.path, self.headers.get('Range'), self.headers.get('Authorization')))
        if self.path.startswith('/cdn/'):
            body = hub.files[self.path[len('/cdn/'):]]['body']
            time.sleep(hub.delay)
            if self.path in hub.cut:  # the first transfer dies half-way through
                hub.cut.remove(self.path)
                self.send_response(200)
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body[:len(body) // 2])
                return
            start = int(re.fullmatch(r'bytes=(\d+)-', self.headers['Range'])[1]) if self.headers.get('Range') else 0
            if start:
                return self.send(206, body[start:], [('Content-Range', f'bytes {start}-{len(body) - 1}/{len(body)}')])
            if hub.rate:  # throttled: hub.rate bytes per second, in pieces
                self.send_response(200)
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 1 << 16):
                    self.wfile.write(body[i:i + (1 << 16)])
                    time.sleep((1 << 16) / hub.rate)
                return
            return self.send(200, body)
        key = re.sub(r'/resolve/[^/]+/', '/', self.path.lstrip('/'))
        f = hub.files.get(key)
        if f is None:
            return self.send(404, b'Entry not found')
        if f.get('gated') and self.headers.get('Authorization') != f"Bearer {f.get('token', 'secret')}":
            return self.send(401, b'Access to this repo is restricted')
        if f.get('lfs'):
            sha = f.get('sha') or hashlib.sha256(f['body']).hexdigest()
            where = f'http://{hub.cdn_host}:{hub.server_port}' if hub.cdn_host else ''  # another host's URL
            return self.send(302, headers=[('Location', f'{where}/cdn/{key}'), ('X-Linked-Etag', f'"{sha}"')])
        # a small file: the ETag is its git blob sha1, which is not a sha256 and must be ignored
        return self.send(200, f['body'], [('ETag', '"' + hashlib.sha1(f['body']).hexdigest() + '"')])


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Hub)
    server.files, server.log, server.cut, server.delay, server.rate, server.cdn_host = {}, [], set(), 0.0, 0, ''
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{server.server_port}')
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path / 'cache'))
    for var in ('HF_TOKEN', 'HF_HUB_OFFLINE', 'LOCAL_RANK'):
        monkeypatch.delenv(var, raising=False)
    yield server
    server.shutdown()
    server.server_close()


def blob(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(scope='session')
def teacher_dir(tmp_path_factory):
    from model import ModelConfig, Transformer
    path = str(tmp_path_factory.mktemp('teacher'))
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=320, n_layer=2, n_embd=48, n_head=2, n_kv_head=2, intermediate_size=64,
                            max_seq_len=64)).save_pretrained(path)
    return path


@pytest.fixture(scope='session')
def shard_dirs(tmp_path_factory):
    """Two prepared sources: the offline corpus's first and second halves, as text files."""
    from pydoc_data.topics import topics
    import data
    root, names = tmp_path_factory.mktemp('shards'), sorted(topics)
    for part, keys in (('a', names[:40]), ('b', names[40:])):
        (root / f'{part}.txt').write_text('<|endoftext|>'.join(topics[k] for k in keys))
        data.prepare([str(root / f'{part}.txt')], str(root / part), val_every=4)
    return str(root / 'a'), str(root / 'b')
