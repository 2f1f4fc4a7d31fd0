"""Nothing the project did not write is removed, nothing is written into a checkpoint, and
careless input ends in one line: each through the real code a user runs."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

import checkpoint
import remote
import sweep
from configurator import configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--arch.n_layer=1', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64',
        '--batch_size=2', '--block_size=32', '--eval_iters=2', '--log_interval=1',
        '--sample.tokens=0', '--warmup_steps=1']


def run(script, *args):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    return r.returncode != 0 and len(lines) == 1 and lines[0].startswith('error:')


def files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, names in os.walk(folder) for f in names)


def arm_state(folder):
    """A sweep's state with one arm, 'a', about to start its first chunk."""
    arm = {'done': 0, 'parent': None, 'args': [], 'status': 'running'}
    return {'arms': {'a': arm}, 'max_steps': 8, 'chunks': 4, 'dir': str(folder), 'base': []}


def test_a_sweep_never_removes_an_arm_folder_it_did_not_make(tmp_path):
    """A folder of the user's named like an arm stays as it is: the arm fails in one line."""
    (tmp_path / 'a').mkdir()
    (tmp_path / 'a' / 'notes.txt').write_text('mine')
    state = arm_state(tmp_path)
    assert sweep.start_chunk(state, 'a', dict(os.environ)) is None
    assert (tmp_path / 'a' / 'notes.txt').read_text() == 'mine'
    assert state['arms']['a']['status'].startswith('failed: ')
    assert 'was not made by this sweep' in state['arms']['a']['status']
    sweep.finish_chunk(state, 'a', 0)
    assert state['arms']['a']['done'] == 0


def test_a_sweep_never_removes_set_aside_checkpoints(tmp_path):
    """An arm of the sweep's own that holds only damaged_ckpt_* and its log: kept, the arm
    fails in one line (before, a resume deleted them and trained from scratch)."""
    folder = tmp_path / 'a'
    folder.mkdir()
    (folder / sweep.MINE).write_text('')
    (folder / 'damaged_ckpt_0000002').mkdir()
    (folder / 'damaged_ckpt_0000002' / 'model.safetensors').write_bytes(b'x' * 10)
    (folder / 'log.jsonl').write_text('{"step": 2, "loss": 1.0}\n')
    before = files(folder)
    state = arm_state(tmp_path)
    assert sweep.start_chunk(state, 'a', dict(os.environ)) is None
    assert files(folder) == before and 'set-aside' in state['arms']['a']['status']


def test_a_sweep_empties_only_its_own_folder_of_a_start_killed_before_its_first_save(tmp_path):
    folder = tmp_path / 'a'
    folder.mkdir()
    (folder / sweep.MINE).write_text('')
    (folder / 'log.jsonl').write_text('{"step": 1, "loss": 1.0}\n')
    sweep.fresh_folder(str(folder))
    assert os.listdir(folder) == [sweep.MINE]


def test_only_ckpt_and_seven_ascii_digits_name_a_checkpoint(tmp_path):
    """Copies, other digits and links are never read, rotated or removed as checkpoints."""
    arabic = 'ckpt_' + '\u0660' * 6 + '\u0662'  # Arabic-Indic digits: \d takes them
    for name in ('ckpt_0000001', 'ckpt_0000002.bak', 'ckpt_0000001 copy', arabic,
                 'ckpt_00000003', 'damaged_ckpt_0000004'):
        (tmp_path / name).mkdir()
    os.symlink(tmp_path / 'ckpt_0000001', tmp_path / 'ckpt_0000009')
    assert checkpoint.checkpoints(str(tmp_path)) == [str(tmp_path / 'ckpt_0000001')]
    assert remote.CKPT.fullmatch('ckpt_0000002')
    assert not remote.CKPT.fullmatch(arabic)


def test_a_checkpoint_damaged_twice_at_one_step_is_set_aside_beside_the_first(tmp_path):
    """The second set-aside at step 2 takes a new name instead of an OSError traceback."""
    for name in ('ckpt_0000002', 'damaged_ckpt_0000002'):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'model.safetensors').write_bytes(name.encode())
    with pytest.raises(FileNotFoundError, match='no intact checkpoint left'):
        checkpoint.latest(str(tmp_path), set_aside=True, warn=False)
    assert (tmp_path / 'damaged_ckpt_0000002' / 'model.safetensors').read_bytes() == \
        b'damaged_ckpt_0000002'
    assert (tmp_path / 'damaged_ckpt_0000002.1' / 'model.safetensors').read_bytes() == \
        b'ckpt_0000002'


@pytest.mark.parametrize('inside', ['ckpt_0000002/model.gguf', 'ckpt_0000002/model.safetensors',
                                    'ckpt_0000002', 'copied/m.gguf'])
def test_no_output_goes_into_a_checkpoint(tmp_path, inside):
    """export.py's --gguf and --merge, eval.py's --out and teach.py's --out refuse a path
    inside a checkpoint folder (named as save names it, or holding a manifest) before any
    work, in one line; the checkpoint is left as it was."""
    for folder in ('ckpt_0000002', 'copied'):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / 'model.safetensors').write_bytes(b'weights')
        (tmp_path / folder / checkpoint.MANIFEST).write_text('{}')
    before = files(tmp_path)
    target = str(tmp_path / inside)
    for script, args in (('export.py', [f'--gguf={target}']), ('export.py', [f'--merge={target}']),
                         ('eval.py', [f'--out={target}', '--tasks=']),
                         ('teach.py', [f'--out={target}'])):
        r = run(script, f'--ckpt={tmp_path / "nowhere"}', *args)
        assert one_line_error(r) and 'inside the checkpoint' in r.stderr, (script, r.stderr)
    assert files(tmp_path) == before
    with pytest.raises(ValueError, match='inside the checkpoint'):
        checkpoint.check_output(target, 'gguf')


def test_eval_refuses_an_out_file_it_cannot_write_before_scoring(tmp_path):
    r = run('eval.py', f'--out={tmp_path / "missing" / "r.json"}', '--tasks=',
            f'--ckpt={tmp_path / "nowhere"}')
    assert one_line_error(r) and 'its folder does not exist' in r.stderr, r.stderr
    r = run('eval.py', f'--out={tmp_path}', '--tasks=', f'--ckpt={tmp_path / "nowhere"}')  # a folder
    assert one_line_error(r) and 'is a folder, or in one this process cannot write' in r.stderr, r.stderr


@pytest.mark.parametrize('arg, message', [
    ('--learning_rate=1e999', 'learning_rate=inf is not a finite number'),
    ('--learning_rate=-1e999', 'learning_rate=-inf is not a finite number'),
    ('--max_steps=None', 'max_steps must be int, got None'),
])
def test_numbers_are_finite_and_none_is_no_number(tmp_path, arg, message):
    r = run('train.py', arg, f'--out_dir={tmp_path / "o"}')
    assert one_line_error(r) and message in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / 'o' / 'log.jsonl')


@pytest.mark.parametrize('text, message', [
    ('learning_rate = (\n', "line 1: SyntaxError"),
    ('max_steps = 10\nlearning_rate = 1 / 0\n', "line 2: ZeroDivisionError: division by zero"),
    ('import not_a_module_anywhere\n', "line 1: ModuleNotFoundError"),
    ('import sys\nmax_steps = 3\nsys.exit(0)\n', "calls exit"),
])
def test_a_config_file_that_raises_is_one_line_naming_its_line(tmp_path, text, message):
    path = tmp_path / 'bad.py'
    path.write_text(text)
    r = run('train.py', str(path), f'--out_dir={tmp_path / "o"}')
    assert one_line_error(r) and f"config file {str(path)!r} {message}" in r.stderr, r.stderr
    with pytest.raises(SystemExit, match=message):
        configure({'max_steps': 1, 'learning_rate': 1.0}, [str(path)])


def test_a_resumed_lora_run_verifies_its_base_as_at_its_start(tmp_path):
    """One flipped byte in the base checkpoint's weights: the resume ends in one line
    instead of training on the damaged base to NaN."""
    base_run, lora_run = tmp_path / 'base', tmp_path / 'lora'
    r = run('train.py', *TINY, '--max_steps=2', '--eval_interval=2', f'--out_dir={base_run}')
    assert r.returncode == 0, r.stderr
    base = base_run / 'ckpt_0000002'
    lora = [*TINY, f'--init_from={base}', '--lora.rank=2', '--max_steps=4', '--eval_interval=2',
            f'--out_dir={lora_run}']
    r = run('train.py', *lora, '--stop_after=2')
    assert r.returncode == 0, r.stderr
    weights = base / 'model.safetensors'
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    before = files(lora_run)
    r = run('train.py', *lora, '--init_from=resume')
    assert one_line_error(r) and 'sha256' in r.stderr, r.stderr
    assert files(lora_run) == before
    assert json.loads((lora_run / 'log.jsonl').read_text().splitlines()[-1])['step'] == 2


@pytest.mark.parametrize('script', ['sample.py', 'eval.py', 'teach.py'])
def test_a_cuda_device_without_cuda_is_one_line(tmp_path, script):
    extra = [f'--out={tmp_path / "shards"}'] if script == 'teach.py' else []
    r = run(script, '--device=cuda', f'--ckpt={tmp_path / "nowhere"}', *extra)
    assert one_line_error(r) and "this torch sees no CUDA GPU; set --device=cpu" in r.stderr, \
        r.stderr


def test_a_log_with_bytes_that_are_no_utf8_loses_those_lines_only(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2}\n{"step": 3, "loss": 1.0}\n')
    assert [r['step'] for r in checkpoint.read_log(str(path))] == [1, 3]
    assert 'line 2 is cut off or no record' in capsys.readouterr().err


EVIL = '''
import os, sys, torch
class Payload:
    def __reduce__(self):
        return (os.system, ('touch ' + sys.argv[2],))
torch.save({'step': 2, 'payload': Payload()}, sys.argv[1])
'''


def test_a_training_state_that_would_run_code_is_refused_in_one_line(tmp_path):
    """A checkpoint whose train_state.pt pickles a call (its manifest made to match, as
    from a bucket someone else controls): the resume ends in one line, nothing runs."""
    out = tmp_path / 'out'
    r = run('train.py', *TINY, '--max_steps=2', '--eval_interval=2', f'--out_dir={out}')
    assert r.returncode == 0, r.stderr
    ckpt = out / 'ckpt_0000002'
    state, ran = ckpt / 'train_state.pt', tmp_path / 'ran'
    subprocess.run([sys.executable, '-c', EVIL, str(state), str(ran)], check=True)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest['train_state.pt'] = checkpoint.fingerprint(str(state))
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    r = run('train.py', *TINY, '--max_steps=4', '--eval_interval=2', f'--out_dir={out}',
            '--init_from=resume')
    assert one_line_error(r) and 'refused, as loading it could run code' in r.stderr, r.stderr
    assert 'weights_only' not in r.stderr and not ran.exists()


@pytest.mark.parametrize('arms, says', [
    ("['a', 'b']", 'arms must be {name: {setting: value}}'),
    ("{'a': None}", 'arms must be {name: {setting: value}}'),
    ("{'a': {}}\nraise RuntimeError('half written')", 'RuntimeError: half written'),
])
def test_a_bad_sweep_file_is_one_line(tmp_path, arms, says):
    path = tmp_path / 'sweep_file.py'
    path.write_text(f"out_dir = {str(tmp_path / 'sw')!r}\nmax_steps = 4\nchunks = 2\n"
                    f"arms = {arms}\n")
    r = run('sweep.py', str(path))
    assert one_line_error(r) and says in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / 'sw')


def test_a_command_before_the_sweep_starts_is_one_line(tmp_path):
    path = tmp_path / 'sweep_file.py'
    path.write_text(f"out_dir = {str(tmp_path / 'sw')!r}\nmax_steps = 4\nchunks = 2\n"
                    "arms = {'a': {}}\n")
    r = run('sweep.py', str(path), 'stop', 'a')
    assert one_line_error(r) and 'has not started' in r.stderr, r.stderr


@pytest.mark.parametrize('line', ['5', '["stop"]', '{"stop": "a"}', '["stop", "nobody"]'])
def test_a_bad_control_line_is_dropped_with_a_warning_once(tmp_path, capsys, line):
    """A line written by hand into control.jsonl that is no command: dropped with a
    warning, counted as seen (so it does not come back at every restart); the next one
    applies."""
    import arms
    state = arm_state(tmp_path)
    state['commands'] = 0
    (tmp_path / 'control.jsonl').write_text(line + '\n' + json.dumps(['stop', 'a']) + '\n')
    arms.apply_commands(state)
    assert 'dropped the command' in capsys.readouterr().err
    assert state['commands'] == 2 and state['arms']['a']['status'] == 'stopped'
    arms.apply_commands(state)
    assert capsys.readouterr().err == ''


@pytest.mark.parametrize('row, says', [
    ({'messages': 5}, "'messages' must be a list of objects"),
    ({'messages': [{'role': 'user', 'content': 3}]}, 'needs a role and a text'),
    ({'conversations': [{'from': ['human'], 'value': 'hi'}]}, 'needs a role and a text'),
])
def test_a_chat_line_of_another_shape_is_a_value_error_naming_it(row, says):
    from tokenizer import chat_turns
    with pytest.raises(ValueError, match=says):
        chat_turns(row)


@pytest.mark.parametrize('text', ['[1, 2]', '{"model": 5}'])
def test_a_tokenizer_json_of_another_shape_is_a_value_error(tmp_path, text):
    from tokenizer import get_tokenizer
    (tmp_path / 'tokenizer.json').write_text(text)
    with pytest.raises(ValueError, match='no JSON object'):
        get_tokenizer(str(tmp_path / 'tokenizer.json'))


@pytest.mark.parametrize('change, says', [
    (lambda tj: tj['model'].pop('merges'), 'are of another shape'),
    (lambda tj: tj['model'].update(merges=[5]), 'its merge 5 is not two tokens'),
    (lambda tj: tj['model'].update(merges=['a b c']), "its merge 'a b c' is not two tokens"),
    (lambda tj: tj['model'].update(merges=['zz qq']), "its merge 'zz qq' is not two tokens"),
    (lambda tj: tj['model'].update(vocab={'a': '1'}), 'are of another shape'),
    (lambda tj: tj['model'].update(vocab=[['a', 1]]), 'are of another shape'),
    (lambda tj: tj.update(added_tokens={'x': 1}), 'are of another shape'),
    (lambda tj: tj.update(added_tokens=[{'content': 'x', 'id': '7'}]), 'are of another shape'),
])
def test_a_tokenizer_json_with_merges_vocab_or_added_tokens_of_another_shape_is_a_value_error(tmp_path, change,
                                                                                              says):
    """Merges missing, not pairs of tokens or naming none of the vocab, a vocab that is no map of
    text to integer ids, added tokens of another shape: each a ValueError naming what (train.py,
    sample.py and eval.py print it as one line), where each was a KeyError or TypeError."""
    from test_data import train_hf_tokenizer
    from tokenizer import get_tokenizer
    train_hf_tokenizer('smollm2', str(tmp_path))
    path = tmp_path / 'tokenizer.json'
    tj = json.loads(path.read_text())
    change(tj)
    path.write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=re.escape(says)):
        get_tokenizer(str(path))


@pytest.mark.parametrize('regex, says', [(r'((a*)*)*\1b', 'BacktrackLimitExceeded'), ('(?<=a', 'Parsing error')])
def test_a_tokenizer_json_whose_regex_fails_is_a_value_error(tmp_path, regex, says):
    """A regex that backtracks too far makes tiktoken panic in Rust (an exception no
    `except Exception` catches) on the first long text; it is tried, and refused, up front."""
    from tokenizer import byte_alphabet, get_tokenizer
    vocab = {c: b for b, c in byte_alphabet().items()}
    split = {'type': 'Split', 'pattern': {'Regex': regex}, 'behavior': 'Isolated', 'invert': False}
    tj = {'model': {'type': 'BPE', 'vocab': vocab, 'merges': []},
          'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [split, {'type': 'ByteLevel', 'use_regex': False}]}}
    (tmp_path / 'tokenizer.json').write_text(json.dumps(tj))
    with pytest.raises(ValueError) as e:
        get_tokenizer(str(tmp_path / 'tokenizer.json'))
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer.json'}: its pre-tokenizer regex fails (")
    assert says in str(e.value) and str(e.value).endswith("); use the tokenizer.json its model was trained with")


def test_the_hub_token_never_goes_over_plain_http_to_another_machine(tmp_path):
    """--init_from=hf://org/repo with HF_ENDPOINT on plain http at another address (here
    127.0.0.2, a listener that records every request): one line, and no request reaches it."""
    import http.server
    import threading
    seen = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            self.send_response(404)
            self.end_headers()

        do_HEAD = do_POST = do_GET

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.2', 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, 'HF_ENDPOINT': f'http://127.0.0.2:{server.server_address[1]}',
           'HF_TOKEN': 'hf_secret_token_value'}
    try:
        r = subprocess.run([sys.executable, 'train.py', '--init_from=hf://org/repo',
                            f'--out_dir={tmp_path / "o"}'], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert one_line_error(r) and 'plain http' in r.stderr, r.stderr
    assert 'hf_secret_token_value' not in r.stderr + r.stdout and seen == []


def test_an_upload_prefix_inside_a_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / 'other' / 'ckpt_0000002'
    ckpt.mkdir(parents=True)
    (ckpt / 'model.safetensors').write_bytes(b'weights')
    with pytest.raises(SystemExit, match='inside the checkpoint'):
        remote.open_store(f'file://{ckpt / "uploads"}', 'run')
    assert os.listdir(ckpt) == ['model.safetensors']


def hub_stub(handler, monkeypatch):
    """A hub on 127.0.0.1 that answers with `handler`; HF_ENDPOINT points at it."""
    import http.server
    import threading
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{server.server_address[1]}')
    return server


def test_a_hub_file_with_an_endless_body_stops_at_its_listed_size(tmp_path, monkeypatch):
    """The hub redirects a large file with its size (X-Linked-Size, 1000 bytes); its CDN
    then sends bytes without end and no Content-Length: the download stops in one error
    just past 1000 bytes, and deletes what it wrote."""
    import http.server
    import hub

    class Endless(http.server.BaseHTTPRequestHandler):
        protocol_version = 'HTTP/1.0'  # the body ends when the connection does: never

        def do_GET(self):
            if not self.path.startswith('/cdn'):
                self.send_response(302)
                self.send_header('Location', '/cdn/blob')
                self.send_header('X-Linked-Size', '1000')
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b'x' * 4096)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass
    server = hub_stub(Endless, monkeypatch)
    try:
        with pytest.raises(hub.DownloadError, match='sends more than the 1,000 bytes'):
            hub.download(hub.endpoint() + '/org/repo/resolve/main/model.safetensors',
                         str(tmp_path / 'model.safetensors'), tries=1)
    finally:
        server.shutdown()
    assert not [n for n in os.listdir(tmp_path) if n.startswith('model.safetensors')]


@pytest.mark.slow
def test_a_kernel_build_killed_halfway_leaves_no_lock_that_blocks_the_next(tmp_path):
    """A real C++ build, SIGKILLed once torch has taken its build lock: the next build
    removes the dead build's lock with one warning and finishes, instead of waiting forever."""
    import signal
    import time
    env = {**os.environ, 'TORCH_EXTENSIONS_DIR': str(tmp_path / 'ext')}
    build = [sys.executable, '-c', 'import kernels; print(kernels.cpp_extension().simd())']
    first = subprocess.Popen(build, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    lock = tmp_path / 'ext' / 'nanobitnet_cpu' / 'lock'
    start = time.time()
    while not lock.exists():
        assert first.poll() is None and time.time() - start < 120, 'the build never started'
        time.sleep(0.05)
    time.sleep(2)  # the compiler at work
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert lock.exists()  # what torch leaves behind
    r = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'left by a build that was killed' in r.stderr and not lock.exists()


@pytest.mark.parametrize('marker', [False, True], ids=['own shards', 'prepared'])
def test_a_shard_with_ids_past_the_vocabulary_is_one_line_before_training(tmp_path, marker):
    """One id past the byte tokenizer's 260 in a val shard: refused at set-up (the embedding
    would be indexed past its end mid-run); a marker keeps the largest id read once."""
    import numpy as np
    from data import write_shard
    folder = tmp_path / 'shards'
    folder.mkdir()
    write_shard(str(folder / 'train_000000.bin'), np.arange(2000) % 256, 1)
    write_shard(str(folder / 'val_000000.bin'), [7] * 999 + [300], 1)
    if marker:
        (folder / 'prepared.json').write_text(json.dumps({'tokenizer': 'bytes', 'format': 'text', 'files': None}))
    r = run('train.py', *TINY, f'--dataset={folder}', '--tokenizer=bytes', f'--out_dir={tmp_path / "out"}')
    assert r.returncode == 1 and r.stderr == (f"error: data: {folder} holds token id 300, past the 260 ids of "
                                              "tokenizer 'bytes'; prepare the shards with it again\n")
    assert not os.path.exists(tmp_path / 'out' / 'log.jsonl')
    if marker:
        assert json.loads((folder / 'prepared.json').read_text())['max_id'] == 300


def test_a_micro_batch_larger_than_the_machine_is_one_line_before_it_is_made(tmp_path):
    """--batch_size=1000000000: refused from a floor on its memory (not grown until the kernel
    kills the process without a word), nothing written. The floor: 32e9 tokens x (ids and targets,
    8 bytes each, and one layer of 32 numbers, 2 bytes each) = 2.56e12 bytes."""
    r = run('train.py', *TINY, '--batch_size=1000000000', f'--out_dir={tmp_path}')
    assert one_line_error(r), r.stderr
    assert re.fullmatch(r"error: model: batch_size=1000000000 x block_size=32 needs over 2,384\.2 GiB a micro-step, "
                        r"more than the RAM \([\d,.]+ GiB\); lower batch_size and raise gradient_accumulation_steps\n",
                        r.stderr), r.stderr
    assert os.listdir(tmp_path) == []
    r = run('train.py', *TINY, '--eval_iters=1000000000', f'--out_dir={tmp_path}')  # made at once
    assert one_line_error(r) and re.fullmatch(r"error: model: eval_iters=1000000000 batches of 64 tokens hold "
                                              r"[\d,.]+ GiB at an evaluation, more than the RAM \([\d,.]+ GiB\); "
                                              r"lower eval_iters\n", r.stderr), r.stderr
    assert os.listdir(tmp_path) == []


def test_a_run_writes_into_no_checkpoint_model_or_other_output(tmp_path):
    """train.py's out_dir (a LoRA's too, inside its base) and dataset inside a checkpoint, or out_dir a
    model's folder; export.py's --merge onto a model, a run folder or a file, its --gguf onto a
    folder: each refused in one line before any work, nothing there changed. A `.tmp_ckpt_*` link in the run's folder (where a save
    is written first) is removed, and the save lands in the run's folder, not the link's target."""
    run_dir, hf, elsewhere = tmp_path / 'run', tmp_path / 'hf', tmp_path / 'elsewhere'
    assert run('train.py', *TINY, '--max_steps=2', f'--out_dir={run_dir}').returncode == 0
    from model import ModelConfig, Transformer
    Transformer(ModelConfig(vocab_size=300, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=64)).save_pretrained(str(hf))
    (tmp_path / 'notes.txt').write_text('mine')
    (tmp_path / 'run-lora.gguf').mkdir()  # where a ternary base's adapters would go beside run.gguf
    before = files(tmp_path)
    ckpt = run_dir / 'ckpt_0000002'
    text = tmp_path / 'notes.txt'
    for script, args, says in (
            ('train.py', [*TINY, '--max_steps=1', f'--out_dir={ckpt}'], 'inside the checkpoint'),
            ('train.py', [*TINY, '--max_steps=1', f'--out_dir={ckpt / "sub"}'], 'inside the checkpoint'),
            ('train.py', [*TINY, '--max_steps=1', f'--out_dir={tmp_path / "new"}', f'--dataset={ckpt / "data"}',
                          f"--prepare.files={{'train': '{text}'}}"], 'inside the checkpoint'),
            ('train.py', [*TINY, '--max_steps=1', f'--out_dir={hf}'], "is a model's folder"),
            ('train.py', [*TINY, '--max_steps=1', f'--init_from={ckpt}', '--lora.rank=2',
                          f'--out_dir={ckpt / "lora"}'], 'inside the checkpoint'),  # adapters in their base
            ('export.py', [f'--ckpt={run_dir}', f'--merge={hf}'], 'is already there'),
            ('export.py', [f'--ckpt={run_dir}', f'--merge={run_dir}'], 'is already there'),
            ('export.py', [f'--ckpt={run_dir}', f'--merge={text}'], 'is already there'),
            ('export.py', [f'--ckpt={run_dir}', f'--gguf={tmp_path}'], 'is a folder'),
            ('export.py', [f'--ckpt={run_dir}', f'--gguf={tmp_path / "run.gguf"}'], 'is a folder')):
        r = run(script, *args)
        assert one_line_error(r) and says in r.stderr, (script, args, r.stderr)
    assert files(tmp_path) == before
    elsewhere.mkdir()
    os.symlink(elsewhere, run_dir / '.tmp_ckpt_0000003', target_is_directory=True)
    r = run('train.py', *TINY, '--max_steps=3', f'--out_dir={run_dir}', '--init_from=resume')
    assert r.returncode == 0, r.stderr
    assert os.listdir(elsewhere) == [] and (run_dir / 'ckpt_0000003').is_dir()
    assert not (run_dir / 'ckpt_0000003').is_symlink() and not os.path.lexists(run_dir / '.tmp_ckpt_0000003')


def test_a_urls_credentials_are_in_no_message_and_no_file_name(tmp_path, monkeypatch):
    """A data URL with a password (user:PASSWORD@host) or a presigned query (X-Amz-Signature,
    X-Amz-Credential): the one-line error of a missing file shows *** in their place, and a file
    that downloads is cached under a name made of the host, the path and a hash, never of them; so
    is a password in HF_ENDPOINT shown nowhere when the hub's file is missing."""
    import http.server
    import threading
    import hub

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'hello\n' if self.path.startswith('/there.txt') else b''
            self.send_response(200 if body else 404)
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path / 'cache'))
    host = f'127.0.0.1:{server.server_address[1]}'
    secrets = ['pa55-word-x', 'AKIAEXAMPLE42', 'sig0123456789abcdef']
    signed = f'?X-Amz-Algorithm=AWS4&X-Amz-Credential={secrets[1]}&X-Amz-Signature={secrets[2]}'
    try:
        for url in (f'http://user:{secrets[0]}@{host}/missing.txt', f'http://{host}/missing.txt{signed}'):
            with pytest.raises(hub.DownloadError) as missing:
                hub.fetch(url)
            assert not any(s in str(missing.value) for s in secrets) and '***' in str(missing.value)
        monkeypatch.setenv('HF_ENDPOINT', f'http://user:{secrets[0]}@{host}')
        with pytest.raises(hub.DownloadError) as missing:
            hub.fetch('hf://datasets/org/name/missing.txt')
        assert secrets[0] not in str(missing.value) and 'user:***@' in str(missing.value)
        path = hub.fetch(f'http://user:{secrets[0]}@{host}/there.txt{signed}')
    finally:
        server.shutdown()
    assert open(path).read() == 'hello\n'
    names = [n for _, _, ns in os.walk(tmp_path / 'cache') for n in ns]
    assert names and not any(s in n for n in names for s in secrets) and 'there.txt' in os.path.basename(path)


@pytest.mark.parametrize('per_read, says', [
    (None, 'sends more than the 10,485,760 bytes a reply of no stated size may send'),
    (0.05, 'did not arrive within 2s'),
])
def test_a_hub_file_of_no_stated_size_has_a_cap_and_a_deadline(tmp_path, monkeypatch, per_read, says):
    """A hub file sent with no Content-Length (and no X-Linked-Size) may be at most 10 MiB, as a
    hub's files past 10 MB are LFS files that state their size; and a whole download gets the header
    limit plus its size at 100 KiB/s: 1 KiB every 0.05 s (never a stall) ends in one error, in time.
    Either way what it wrote is not the file."""
    import http.server
    import hub

    class Unsized(http.server.BaseHTTPRequestHandler):
        protocol_version = 'HTTP/1.0'  # the body ends when the connection does

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b'{' * 1024)
                    if per_read:
                        time.sleep(per_read)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass
    server = hub_stub(Unsized, monkeypatch)
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path))
    monkeypatch.setenv('NANOBITNET_HUB_TIMEOUT', '1')
    monkeypatch.setattr(hub, 'HUB_UNSIZED', 10 * 2 ** 20 if per_read is None else 102400)
    start = time.monotonic()
    try:
        with pytest.raises(hub.DownloadError) as refused:
            hub.hub_download('org/repo', 'config.json')
    finally:
        server.shutdown()
    assert time.monotonic() - start < 30
    assert says in str(refused.value) and '\n' not in str(refused.value)
    assert not os.path.exists(hub.hub_file('org/repo', 'config.json')[1])


def test_ids_past_the_vocabulary_in_a_mixture_or_behind_a_stale_marker_are_one_line(tmp_path):
    """A mixture's folder is checked as dataset is (its tokenizer, its largest id), and a marker's
    largest id counts only for the shards it was read from: a shard rewritten since (another size or
    time) is read again. A mixture entry that is no (folder, weight above 0) pair is one line too."""
    import numpy as np
    from data import write_shard

    def shards(name, top):
        folder = tmp_path / name
        folder.mkdir()
        write_shard(str(folder / 'train_000000.bin'), np.arange(2000) % 256, 1)
        write_shard(str(folder / 'val_000000.bin'), [7] * 999 + [top], 1)
        (folder / 'prepared.json').write_text(json.dumps({'tokenizer': 'bytes', 'format': 'text', 'files': None}))
        return folder
    good, bad = shards('good', 9), shards('bad', 300)
    common = [*TINY, '--max_steps=1', f'--dataset={good}', '--tokenizer=bytes']
    r = run('train.py', *common, f"--mixture={{'a': ('{good}', 1.0), 'b': ('{bad}', 1.0)}}", f'--out_dir={tmp_path / "m"}')
    assert one_line_error(r) and f"{bad} holds token id 300, past the 260 ids" in r.stderr, r.stderr
    for entry in ("('x',)", f"('{good}', 0.0)", f"('{good}', -1.0)", f"('{good}', '1')", f"'{good}'"):
        r = run('train.py', *common, f"--mixture={{'a': {entry}}}", f'--out_dir={tmp_path / "w"}')
        assert one_line_error(r) and "is no (folder, weight above 0) pair" in r.stderr, (entry, r.stderr)
    r = run('train.py', *common, f'--out_dir={tmp_path / "first"}')
    assert r.returncode == 0 and json.loads((good / 'prepared.json').read_text())['max_id'] == 255
    write_shard(str(good / 'val_000000.bin'), [7] * 1999 + [300], 1)  # rewritten: the marker is stale
    r = run('train.py', *common, f'--out_dir={tmp_path / "second"}')
    assert one_line_error(r) and f"{good} holds token id 300" in r.stderr, r.stderr


@pytest.mark.parametrize('script', ['sample.py', 'eval.py', 'export.py', 'train.py'])
def test_a_config_json_that_is_no_object_is_one_line(tmp_path, script):
    """A model folder whose config.json is a JSON list: each script that opens models says so in one
    line (no AttributeError traceback)."""
    folder = tmp_path / 'model'
    folder.mkdir()
    (folder / 'config.json').write_text('[1, 2, 3]')
    args = {'sample.py': [f'--ckpt={folder}'], 'eval.py': [f'--ckpt={folder}'],
            'export.py': [f'--ckpt={folder}', f'--gguf={tmp_path / "m.gguf"}'],
            'train.py': [*TINY, f'--init_from={folder}', f'--out_dir={tmp_path / "o"}']}[script]
    r = run(script, *args)
    assert one_line_error(r) and 'config.json holds a list, not a JSON object' in r.stderr, r.stderr


def request(doc=0, idx=0, label=0, context='Q: 1+1?\nA:', continuation=' 2'):
    return json.dumps({'doc_id': doc, 'idx': idx, 'label': label,
                       'request': {'context': context, 'continuation': continuation}})


@pytest.mark.parametrize('lines, says', [
    (['[1, 2]'], 'request line 1 is no object'),
    ([request(), request(idx=1, context=None)], 'request line 2 is no object'),
    ([request(), request(idx=1, continuation='')], 'request line 2 is no object'),
    ([request(label=2), request(idx=1, label=2)], 'its label 2 names none of its 2 choices'),
    ([request(), request(idx=2)], 'names none of its 2 choices'),
    ([], 'holds no question'),
])
def test_a_task_file_of_another_shape_is_a_value_error_naming_the_line(lines, says):
    """eval.py's task lines are data: a list, a null context, an empty continuation, a label that names
    no choice (it was scored as always wrong), or no line at all: each a ValueError that names it,
    which eval.py and train.py print as one line."""
    import eval
    with pytest.raises(ValueError, match=re.escape(says)):
        eval.questions(lines)
    assert eval.questions([request(), request(idx=1, continuation=' 3')]) == \
        [{'choices': [('Q: 1+1?\nA:', ' 2'), ('Q: 1+1?\nA:', ' 3')], 'gold': 0}]


@pytest.mark.parametrize('marker', ['[1, 2]', '{"tokenizer": "bytes", "max_id": "300"}', '{"max_id": 3}', '{'])
def test_a_marker_of_another_shape_is_one_line(tmp_path, marker):
    """A folder's prepared.json that is a list, keeps its largest id as a string, names no tokenizer
    or is cut off: one line naming it, before training (no KeyError or TypeError traceback)."""
    import numpy as np
    from data import write_shard
    folder = tmp_path / 'shards'
    folder.mkdir()
    write_shard(str(folder / 'train_000000.bin'), np.arange(2000) % 256, 1)
    (folder / 'prepared.json').write_text(marker)
    r = run('train.py', *TINY, f'--dataset={folder}', '--tokenizer=bytes', f'--out_dir={tmp_path / "out"}')
    assert one_line_error(r) and 'prepared.json is no marker prepare wrote' in r.stderr, r.stderr


def test_a_config_json_with_a_number_written_as_text_is_one_line(tmp_path):
    """"num_hidden_layers": "2" (text, not a number): sample.py says so in one line naming the key,
    where it ended in a TypeError deep inside the model."""
    from model import ModelConfig, Transformer
    folder = tmp_path / 'model'
    Transformer(ModelConfig(vocab_size=300, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=64)).save_pretrained(str(folder))
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps(dict(config, num_hidden_layers='2')))
    r = run('sample.py', f'--ckpt={folder}', '--num_tokens=2')
    assert one_line_error(r) and "config.json: num_hidden_layers is '2', not a number" in r.stderr, r.stderr
