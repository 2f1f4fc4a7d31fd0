"""teachers.py's RemoteTeacher against a real HTTP server on 127.0.0.1 that answers like vLLM's
completions endpoint: a reply is checked before use, a bad one is retried as a network error is
and then refused in one line, and a good one lines up entry i + 1 with student position i."""
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from teachers import RemoteTeacher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50


def entry(token, k, trouble):
    """The top k after `token` (ids token + 1, token + 2, ..., logprobs -1, -2, ...) and the
    actual token, as vLLM keys them (a string of the id), spoiled as `trouble` says."""
    top = {str((token + j) % VOCAB): {'logprob': -float(j), 'rank': j} for j in range(1, k + 1)}
    top.setdefault(str(token), {'logprob': -20.0, 'rank': 40})
    if trouble == 'word key':
        top['the'] = top.pop(str(token))
    if trouble == 'padded key':
        top['007'] = top.pop(str(token))
    if trouble == 'past the vocabulary':
        top[str(VOCAB)] = top.pop(str(token))
    if trouble == 'too few':
        top = dict(list(top.items())[:k - 1])
    if trouble == 'no logprob':
        top[str(token)] = {'rank': 1}
    if trouble == 'nan logprob':
        top[str(token)] = {'logprob': float('nan')}
    if trouble == 'positive logprob':
        top[str(token)] = {'logprob': 50.0}
    if trouble == 'true logprob':
        top[str(token)] = {'logprob': True}
    return top


def vllm_stub(trouble=None):
    """A server whose every reply is spoiled as `trouble` says (None: a good one); it counts
    the requests it gets in server.requests."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
            self.server.requests += 1
            ids, k = body['prompt'], body['prompt_logprobs']
            entries = [None] + [entry(t, k, trouble) for t in ids[1:]]
            if trouble == 'one entry short':
                entries = entries[:-1]
            out = json.dumps({'choices': [{'prompt_logprobs': entries}]}).encode()
            self.send_response(200)
            self.send_header('Content-Length', str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    server.requests = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}'


def test_a_good_reply_lines_up_with_the_student_positions():
    server, url = vllm_stub()
    try:
        x = torch.tensor([[3, 7, 11, 49], [0, 1, 2, 3]])
        y = torch.tensor([[7, 11, 49, 5], [1, 2, 3, 48]])
        out = RemoteTeacher(url, 'tiny', top_k=3, vocab_size=VOCAB)(x, y)
    finally:
        server.shutdown()
    assert server.requests == 2  # one per sequence
    # position i predicts y[:, i]: the entry after token y[:, i], best first
    expect = (y[:, :, None] + torch.arange(1, 4)) % VOCAB
    assert torch.equal(out['topk_ids'], expect)
    assert torch.equal(out['topk_logprobs'], -torch.arange(1.0, 4.0).expand(2, 4, 3))


def refusal(teacher, server):
    """The one-line error the teacher stops with on a few tokens; the server shut down after."""
    x = torch.tensor([[3, 7, 11, 49]])
    try:
        with pytest.raises(SystemExit) as refused:
            teacher(x, x)
    finally:
        server.shutdown()
    return str(refused.value)


@pytest.mark.parametrize('trouble, says', [
    ('word key', "key 'the' is not a token id"),
    ('padded key', "key '007' is not a token id"),
    ('past the vocabulary', f"token id {VOCAB} is past the vocabulary ({VOCAB})"),
    ('too few', "entry 1 does not hold the top 3 tokens"),
    ('no logprob', "has no logprob"),
    ('nan logprob', "has no logprob"),
    ('positive logprob', "has no logprob <= 0"),
    ('true logprob', "has no logprob <= 0"),
    ('one entry short', "prompt_logprobs is not a list of 5 entries"),
])
def test_a_bad_reply_is_retried_then_refused_in_one_line(trouble, says):
    server, url = vllm_stub(trouble)
    teacher = RemoteTeacher(url, 'tiny', top_k=3, retries=2, backoff=0.01, vocab_size=VOCAB)
    message = refusal(teacher, server)
    assert server.requests == 3  # the first try and two retries
    assert message.startswith(f"error: teacher server {url}/v1/completions failed after 3 tries")
    assert says in message and 'check that vLLM serves' in message and '\n' not in message


@pytest.mark.slow
def test_a_bad_reply_ends_a_training_run_in_one_line(tmp_path):
    server, url = vllm_stub('word key')
    try:
        r = subprocess.run([sys.executable, 'train.py', f'--teacher={url}', '--vllm.model=tiny',
                            "--objectives={'kd': {}}", "--curriculum=[(1.0, {'kd': 1.0})]",
                            '--vllm.top_k=3', '--arch.n_layer=1', '--arch.n_embd=32', '--arch.n_head=2',
                            '--arch.n_kv_head=1', '--arch.intermediate_size=64', '--batch_size=2',
                            '--block_size=16', '--max_steps=2', f'--out_dir={tmp_path}'],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"error: teacher server {url}")
    assert r.stderr.count('error:') == 1


def dripping_server(body_bytes, per_second):
    """A vLLM-shaped server that sends a 200, then body_bytes bytes (no Content-Length) at
    per_second bytes a second, or as fast as it can (None)."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers['Content-Length']))
            self.send_response(200)
            self.end_headers()
            try:
                for start in range(0, body_bytes, 1 if per_second else 1 << 16):
                    self.wfile.write(b' ' * (1 if per_second else min(1 << 16, body_bytes - start)))
                    self.wfile.flush()
                    if per_second:
                        time.sleep(1 / per_second)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}'


@pytest.mark.parametrize('body_bytes, per_second, says', [
    (10 ** 6, 20, 'no whole reply in 2 s'),  # a byte at a time: no read ever times out
    (600 * 2 ** 20, None, 'its reply runs past'),  # 600 MiB, fast
])
def test_a_slow_or_endless_reply_ends_in_one_line_within_the_deadline(body_bytes, per_second, says):
    server, url = dripping_server(body_bytes, per_second)
    teacher = RemoteTeacher(url, 'tiny', top_k=3, timeout=2.0, retries=0, vocab_size=VOCAB)
    start = time.monotonic()
    try:
        with pytest.raises(SystemExit) as refused:
            teacher(torch.tensor([[3, 7, 11, 49]]), torch.tensor([[7, 11, 49, 5]]))
    finally:
        server.shutdown()
    assert says in str(refused.value) and '\n' not in str(refused.value)
    assert time.monotonic() - start < 10


def test_a_teacher_urls_password_is_never_printed_logged_or_saved(tmp_path):
    """--teacher=http://user:PASSWORD@host: the one-line error of a bad server, what --check prints and
    the settings a checkpoint saves (train_state.pt, which is uploaded) show *** where the password was."""
    secret = 'hunter2-s3cret'
    server, url = vllm_stub('word key')
    with_password = url.replace('http://', f'http://student:{secret}@')
    teacher = RemoteTeacher(with_password, 'tiny', top_k=3, retries=0, backoff=0.01, vocab_size=VOCAB)
    message = refusal(teacher, server)
    assert secret not in message and 'student:***@' in message
    server, url = vllm_stub()
    with_password = url.replace('http://', f'http://student:{secret}@')
    args = [sys.executable, 'train.py', f'--teacher={with_password}', '--vllm.model=tiny', "--objectives={'kd': {}}",
            "--curriculum=[(1.0, {'kd': 1.0})]", '--vllm.top_k=3', '--arch.n_layer=1', '--arch.n_embd=32',
            '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64', '--batch_size=2',
            '--block_size=16', '--max_steps=1', '--eval_iters=1', '--sample.tokens=0', f'--out_dir={tmp_path}']
    try:
        checked = subprocess.run([*args, '--check'], cwd=ROOT, capture_output=True, text=True, timeout=300)
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert checked.returncode == 0 and secret not in checked.stdout and 'student:***@' in checked.stdout
    assert r.returncode == 0, r.stderr
    assert server.requests > 0 and secret not in r.stdout + r.stderr
    state = torch.load(tmp_path / 'ckpt_0000001' / 'train_state.pt', weights_only=True)
    assert state['config']['teacher'] == url.replace('http://', 'http://student:***@')
    for folder, _, names in os.walk(tmp_path):
        for name in names:
            assert secret.encode() not in open(os.path.join(folder, name), 'rb').read(), name


def test_a_teacher_sending_its_headers_a_byte_at_a_time_ends_within_the_deadline():
    """A server that trickles its status line and headers (one byte every 0.2 s: no read ever
    times out) is given the teacher's timeout in all, from the request on: one line, in time."""
    import socket
    listener = socket.socket()
    listener.bind(('127.0.0.1', 0))
    listener.listen()
    stop = threading.Event()

    def trickle():
        connection, _ = listener.accept()
        connection.recv(65536)
        for byte in b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Padding: ' + b'x' * 400:
            if stop.is_set():
                break
            connection.sendall(bytes([byte]))
            time.sleep(0.2)
        connection.close()
    threading.Thread(target=trickle, daemon=True).start()
    url = f'http://127.0.0.1:{listener.getsockname()[1]}'
    teacher = RemoteTeacher(url, 'tiny', top_k=3, timeout=2.0, retries=0, vocab_size=VOCAB)
    start = time.monotonic()
    try:
        with pytest.raises(SystemExit) as refused:
            teacher(torch.tensor([[3, 7, 11, 49]]), torch.tensor([[7, 11, 49, 5]]))
    finally:
        stop.set()
    assert time.monotonic() - start < 6
    message = str(refused.value)
    assert 'did not answer within 2s' in message and 'NANOBITNET_TEACHER_TIMEOUT' in message and '\n' not in message
