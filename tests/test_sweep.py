"""sweep.py: arms trained in chunks compute what they compute straight through, the chunks go in
the stated order, successive halving and the stop / resume / clone commands do what they say,
and a sweep killed mid-chunk ends with the uninterrupted sweep's table."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import arms as sweep_arms
import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(arch=dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64), batch_size=4, block_size=32,
            eval_iters=2, log_interval=1, warmup_steps=2, eval_interval=4)


def write_sweep(tmp_path, arms, chunks=4, halving=False, name='sweep'):
    path = tmp_path / f'{name}.py'
    path.write_text(f"out_dir = {str(tmp_path / name)!r}\nbase = {TINY!r}\nmax_steps = 8\n"
                    f"chunks = {chunks}\narms = {arms!r}\nhalving = {halving}\n")
    return str(path)


def run(*args):
    return subprocess.run([sys.executable, 'sweep.py', *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def log(folder):
    with open(os.path.join(folder, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def tables(folder):
    with open(os.path.join(folder, 'sweep.jsonl')) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_three_arms_in_four_chunks_equal_their_straight_runs_and_take_turns(tmp_path, teacher_dir, shard_dirs):
    arms = {'plain': {},
            'distill': {'teacher': teacher_dir, 'objectives': {'ce': {}, 'kd': {}, 'diffusion': {}},
                        'curriculum': [(0.25, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'diffusion': 0.5})]},
            'mixture': {'dataset': shard_dirs[0], 'mixture': {'a': (shard_dirs[0], 1.0), 'b': (shard_dirs[1], 1.0)},
                        'remix': {'interval': 3}}}
    r = run(write_sweep(tmp_path, arms))
    assert r.returncode == 0, r.stderr
    for name, overrides in arms.items():
        straight = str(tmp_path / f'straight_{name}')
        cmd = [sys.executable, 'train.py', *sweep_arms.arguments({**TINY, **overrides}), '--max_steps=8',
               '--sample.tokens=0', f'--out_dir={straight}']
        assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=600).returncode == 0
        a, b = log(straight), log(tmp_path / 'sweep' / name)
        assert [x['step'] for x in b] == list(range(1, 9))
        for x, y in zip(a, b):
            assert x['loss'] == y['loss'] and x['lr_hidden'] == y['lr_hidden'], (name, x, y)
    # one chunk per table: the arm with the fewest chunks done goes next, the first named on a tie
    steps = [[row['step'] for row in t] for t in tables(tmp_path / 'sweep')]
    advanced = [next(i for i, (u, v) in enumerate(zip(before, after)) if u != v)
                for before, after in zip([[0, 0, 0]] + steps, steps)]
    assert advanced == [0, 1, 2] * 4
    assert [row['status'] for row in tables(tmp_path / 'sweep')[-1]] == ['done'] * 3
    assert os.path.exists(tmp_path / 'sweep' / 'sweep.svg')


def test_the_next_arm_and_successive_halving():
    arms = {n: dict(done=d, status=s) for n, d, s in
            [('a', 2, 'running'), ('b', 1, 'running'), ('c', 1, 'running'), ('d', 0, 'stopped')]}
    state = dict(arms=arms, halving=False)
    assert sweep.next_arm(state, busy=()) == 'b'  # fewest done, then the first named
    assert sweep.next_arm(state, busy={'b'}) == 'c'  # not one in flight
    assert sweep.next_arm(state, busy={'b', 'c'}) == 'a'
    state['halving'] = True  # ... but under halving no arm gets a chunk ahead of one in flight
    assert sweep.next_arm(state, busy={'b', 'c'}) is None
    arms['b']['done'] = arms['c']['done'] = 2
    assert sweep.next_arm(state, busy=()) == 'a'
    state = dict(arms={n: dict(done=2, status='running') for n in 'abcde'}, chunks=4, halved=[])
    sweep.halve(state, dict(a=3.0, b=1.0, c=2.0, d=5.0, e=4.0))
    assert {n: a['status'] for n, a in state['arms'].items()} == dict(
        a='running', b='running', c='running', d='halved', e='halved')  # the better half, rounded up
    sweep.halve(state, dict(a=3.0, b=1.0, c=2.0))
    assert state['halved'] == [2] and state['arms']['a']['status'] == 'running'  # once per chunk count
    state['arms']['a']['done'] = 3
    sweep.halve(state, dict(a=3.0, b=1.0, c=2.0))  # not every running arm at 3 chunks yet
    assert state['halved'] == [2]


def test_each_worker_gets_a_gpu_or_a_share_of_the_cores(monkeypatch):
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    monkeypatch.setattr(sweep.torch.cuda, 'device_count', lambda: 0)
    assert sweep.worker_env(1, workers=2)['OMP_NUM_THREADS'] == str(max(1, os.cpu_count() // 2))
    assert 'OMP_NUM_THREADS' not in sweep.worker_env(0, workers=1)  # one worker: torch's own default
    monkeypatch.setattr(sweep.torch.cuda, 'device_count', lambda: 2)
    assert [sweep.worker_env(s, 3)['CUDA_VISIBLE_DEVICES'] for s in range(3)] == ['0', '1', '0']
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '3,5')  # the GPUs the sweep was given
    assert [sweep.worker_env(s, 2)['CUDA_VISIBLE_DEVICES'] for s in range(2)] == ['3', '5']
    assert 'OMP_NUM_THREADS' not in sweep.worker_env(0, 2)


@pytest.mark.slow
def test_stop_resume_and_clone_between_chunks(tmp_path):
    path = write_sweep(tmp_path, {'a': {}, 'b': {'learning_rate': 1e-3}}, chunks=2)
    folder = str(tmp_path / 'sweep')
    state = sweep.new_sweep(path)
    os.makedirs(folder)
    sweep.finish_chunk(state, 'a', sweep.start_chunk(state, 'a', env=None).wait())
    json.dump(state, open(os.path.join(folder, 'sweep.json'), 'w'))
    assert run(folder, 'stop', 'b').returncode == 0
    assert run(folder, 'clone', 'a', 'a_slow', '--learning_rate=1e-4').returncode == 0
    r = run(folder)
    assert r.returncode == 0, r.stderr
    final = {row['arm']: row for row in tables(folder)[-1]}
    assert final['b']['step'] == 0 and final['b']['status'] == 'stopped'
    assert final['a']['step'] == 8 and final['a_slow']['step'] == 8 and final['a_slow']['status'] == 'done'
    clone = log(os.path.join(folder, 'a_slow'))
    assert clone[0]['lr_hidden'] < log(os.path.join(folder, 'a'))[0]['lr_hidden']  # its own settings
    # ... and its parent's weights after the parent's first chunk: on the same first batch (the
    # clone's data starts over) its loss is the trained one, not the parent's initial 5.7
    parent = log(os.path.join(folder, 'a'))
    assert clone[0]['loss'] < parent[0]['loss'] - 0.2 and abs(clone[0]['loss'] - parent[3]['loss']) < 0.2
    assert run(folder, 'resume', 'b').returncode == 0
    assert run(folder).returncode == 0
    final = {row['arm']: row for row in tables(folder)[-1]}
    assert final['b']['step'] == 8 and final['b']['status'] == 'done'


@pytest.mark.slow
def test_a_command_to_the_folder_works_before_the_first_chunk_ends(tmp_path):
    """The sweep's state is in DIR from the start, so `sweep.py DIR stop ARM` needs no finished chunk."""
    path = write_sweep(tmp_path, {'a': {}, 'b': {}}, chunks=2)
    folder = tmp_path / 'sweep'
    proc = subprocess.Popen([sys.executable, 'sweep.py', path], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    t0 = time.time()
    while not os.path.exists(folder / 'sweep.json'):
        assert proc.poll() is None and time.time() - t0 < 300
        time.sleep(0.05)
    assert not list(folder.glob('*/ckpt_*'))  # no chunk had ended
    r = run(str(folder), 'stop', 'b')
    assert r.returncode == 0, r.stderr
    assert proc.wait(timeout=600) == 0
    final = {row['arm']: row for row in tables(folder)[-1]}
    assert final['a']['step'] == 8 and final['b']['status'] == 'stopped' and final['b']['step'] < 8


@pytest.mark.slow
def test_a_sweep_killed_mid_chunk_ends_with_the_uninterrupted_table(tmp_path):
    arms = {'a': {}, 'b': {'learning_rate': 1e-3}}
    assert run(write_sweep(tmp_path, arms, halving=True, name='straight')).returncode == 0
    path = write_sweep(tmp_path, arms, halving=True, name='killed')
    proc = subprocess.Popen([sys.executable, 'sweep.py', path], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.time()
    while not os.path.exists(tmp_path / 'killed' / 'b' / 'ckpt_0000002'):  # b's first chunk done
        assert proc.poll() is None and time.time() - t0 < 300
        time.sleep(0.05)
    time.sleep(1.0)  # into the next chunk
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its train.py
    proc.wait()
    r = run(path)
    assert r.returncode == 0, r.stderr
    last = lambda name: [{k: v for k, v in row.items() if k != 'minutes'} for row in tables(tmp_path / name)[-1]]
    assert last('killed') == last('straight')


@pytest.mark.slow
def test_two_workers_train_two_arms_at_once_to_the_same_table(tmp_path):
    arms = {'a': {}, 'b': {'learning_rate': 1e-3}, 'c': {'learning_rate': 1e-2}}
    assert run(write_sweep(tmp_path, arms, chunks=2, name='one')).returncode == 0
    proc = subprocess.Popen([sys.executable, 'sweep.py', write_sweep(tmp_path, arms, chunks=2, name='two'),
                             '--workers=2'], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children = f'/proc/{proc.pid}/task/{proc.pid}/children'
    at_once = 0
    while proc.poll() is None:
        try:
            at_once = max(at_once, len(open(children).read().split()))
        except FileNotFoundError:  # the sweep has just ended
            pass
        time.sleep(0.05)
    assert proc.returncode == 0, proc.stderr.read()
    assert at_once == 2  # two train.py processes, never more
    one, two = tables(tmp_path / 'one'), tables(tmp_path / 'two')
    assert len(two) <= len(one) == 6  # a table after each chunk, or after chunks that end together
    for x, y in zip(one[-1], two[-1]):  # each worker has one core: the same losses to rounding
        assert (x['arm'], x['step'], x['tokens'], x['status']) == (y['arm'], y['step'], y['tokens'], y['status'])
        assert x['val_loss'] == pytest.approx(y['val_loss'], rel=1e-5)
        assert x['loss'] == pytest.approx(y['loss'], rel=1e-5)


def test_bad_input_is_one_line_before_any_arm_starts(tmp_path):
    r = run(write_sweep(tmp_path, {'ok': {}, 'typo': {'learning_rat': 1e-3}}))
    assert r.returncode == 1
    assert r.stderr == "error: arm 'typo': unknown config key 'learning_rat'; did you mean --learning_rate?\n"
    assert not os.path.exists(tmp_path / 'sweep' / 'ok')
    r = run(write_sweep(tmp_path, {'ok': {}, 'fast': {'learning_rate': 'fast'}}))  # checked as train.py checks
    assert r.returncode == 1 and r.stderr == "error: arm 'fast': learning_rate must be float, got 'fast' (str)\n"
    r = run(write_sweep(tmp_path, {'ok': {}}), '--workers=0')  # read through configurator.py
    assert r.returncode == 1 and r.stderr == "error: workers=0 is out of range; set --workers to a value above 0\n"
    r = run('--workers=2')
    assert r.returncode == 1 and r.stderr.startswith('usage: python sweep.py SWEEP_FILE | DIR [--workers=N')
    folder = tmp_path / 'sweep'
    os.makedirs(folder)
    json.dump(sweep.new_sweep(write_sweep(tmp_path, {'a': {}})), open(folder / 'sweep.json', 'w'))
    r = run(str(folder), 'clone', 'nope', 'new', '--learning_rate=1e-3')
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and "clone nope" in r.stderr
    r = run(str(folder), 'clone', 'a', 'new', '--learnin_rate=1e-3')
    assert r.returncode == 1 and r.stderr.startswith("error: arm 'new': unknown config key 'learnin_rate'")
    r = run(str(folder), 'clone', 'a', 'new', '--workers=2')  # what follows a command is the arm's
    assert r.returncode == 1 and r.stderr == "error: arm 'new': unknown config key 'workers'\n"
    r = run(str(folder), '--workers=2', 'stop')
    assert r.returncode == 1 and r.stderr == "error: stop: name an arm, as in stop ARM\n"


@pytest.mark.parametrize('key, text', [
    ('chunks', "out_dir = 'out'\nmax_steps = 8\narms = {'a': {}}\n"),
    ('max_steps', "out_dir = 'out'\nchunks = 2\nbase = {'max_steps': 8}\narms = {'a': {}}\n"),
    ('max_steps', "out_dir = 'out'\nmax_steps = 8\nchunks = 2\narms = {'a': {}, 'b': {'max_steps': 4}}\n"),
    ('max_steps', "out_dir = 'out'\nmax_steps = 8.0\nchunks = 2\narms = {'a': {}}\n"),
    ('out_dir', "max_steps = 8\nchunks = 2\narms = {'a': {}}\n"),
    ('out_dir', "out_dir = 'out'\nmax_steps = 8\nchunks = 2\ngrid = {'out_dir': ['x', 'y']}\n"),
])
def test_a_sweep_file_must_set_its_own_settings_at_its_top(tmp_path, key, text):
    path = tmp_path / 'sweep.py'
    path.write_text(text)
    r = run(str(path))
    kind = 'str' if key == 'out_dir' else 'int'
    assert r.returncode == 1 and 'Traceback' not in r.stderr
    assert r.stderr == (f"error: {path}: set {key} ({kind}) at the top of the sweep file, once for every arm, "
                        f"not in base or an arm\n")


def test_a_cut_off_command_is_dropped_with_a_warning(tmp_path):
    folder = tmp_path / 'sweep'
    os.makedirs(folder)
    json.dump(sweep.new_sweep(write_sweep(tmp_path, {'a': {}, 'b': {}})), open(folder / 'sweep.json', 'w'))
    # a crash while the clone was being queued: the file ends mid-line
    (folder / 'control.jsonl').write_text('["stop", "a"]\n["stop", "b"]\n["clone", "a", "c", "--learn')
    r = run(str(folder))  # both arms stopped: the sweep applies the commands and has nothing to train
    assert r.returncode == 0 and 'Traceback' not in r.stderr
    assert r.stderr == (f"warning: {folder / 'control.jsonl'}: dropped the cut-off line "
                        f"'[\"clone\", \"a\", \"c\", \"--learn'; queue that command again\n")
    r = run(str(folder), 'resume', 'a')  # queued on a line of its own, not joined to the cut-off one
    assert r.returncode == 0 and r.stderr.startswith('warning:') and r.stderr.count('\n') == 1
    assert (folder / 'control.jsonl').read_text().splitlines()[-2:] == ['["clone", "a", "c", "--learn',
                                                                        '["resume", "a"]']
    state = json.load(open(folder / 'sweep.json'))
    sweep.apply_commands(state)
    assert {n: a['status'] for n, a in state['arms'].items()} == {'a': 'running', 'b': 'stopped'}
    assert state['commands'] == 4


def test_an_arms_log_cut_off_mid_line_gives_its_last_whole_record(tmp_path, capsys):
    state = sweep.new_sweep(write_sweep(tmp_path, {'a': {}}))
    os.makedirs(os.path.join(state['dir'], 'a'))
    with open(os.path.join(state['dir'], 'a', 'log.jsonl'), 'w') as f:
        f.write('{"step": 4, "loss": 2.5, "tokens": 512, "val_loss": 2.75}\n{"step": 5, "lo')
    row = sweep_arms.table(state)[0]
    assert (row['step'], row['loss'], row['val_loss'], row['tokens']) == (4, 2.5, 2.75, 512)
    assert 'line 2 is cut off or no record; dropping it' in capsys.readouterr().err


def test_a_sweep_never_takes_a_folder_it_did_not_make(tmp_path):
    """A run of the user's at S/a, then a sweep in S with an arm a: the arm fails in one line, the
    user's checkpoints and log stay byte for byte, and the other arm trains."""
    user = tmp_path / 'sweep' / 'a'
    cmd = [sys.executable, 'train.py', *sweep_arms.arguments(TINY), '--max_steps=4', '--ckpt.interval=2',
           '--sample.tokens=0', f'--out_dir={user}']
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=600).returncode == 0
    files = lambda: {p: open(os.path.join(h, p), 'rb').read() for h, _, ps in os.walk(user) for p in ps}
    before = files()
    r = run(write_sweep(tmp_path, {'a': {}, 'b': {}}, chunks=2))
    assert r.returncode == 0, r.stderr
    assert 'error: arm a: ' in r.stderr and 'was not made by this sweep' in r.stderr
    assert files() == before
    status = {row['arm']: row['status'] for row in tables(tmp_path / 'sweep')[-1]}
    assert status['a'].startswith('failed: ') and status['b'] == 'done'


def test_one_sweep_process_at_a_time_and_a_killed_one_leaves_no_lock(tmp_path):
    """While sweep.py runs a sweep, a second sweep.py on it is refused in one line; a command to the
    running sweep is still taken. Killed (SIGKILL), it leaves nothing stuck: the next one finishes it."""
    path = write_sweep(tmp_path, {'a': {}, 'b': {'learning_rate': 1e-3}})
    proc = subprocess.Popen([sys.executable, 'sweep.py', path], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.time()
    while not os.path.exists(tmp_path / 'sweep' / 'a' / 'ckpt_0000002'):
        assert proc.poll() is None and time.time() - t0 < 300
        time.sleep(0.05)
    r = run(path)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'running in another process' in r.stderr
    assert run(str(tmp_path / 'sweep'), 'stop', 'b').returncode == 0
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    r = run(path)
    assert r.returncode == 0, r.stderr
    status = {row['arm']: row['status'] for row in tables(tmp_path / 'sweep')[-1]}
    assert status == {'a': 'done', 'b': 'stopped'}


@pytest.mark.parametrize('arms, says', [
    ("{'a': {}, 'a': {'learning_rate': 1e-3}}", "the arm 'a' is named twice"),
    ("{'learning_rate=0.001': {}}\ngrid = {'learning_rate': [0.001, 0.002]}", "'learning_rate=0.001' is named twice"),
    ("{'b': {}, 'b.stderr': {}}", "arm 'b.stderr': an arm's name is its folder's"),
    ("{'../up': {}}", "arm '../up': an arm's name is its folder's"),
    ("{'sweep.json': {}}", "arm 'sweep.json': an arm's name is its folder's"),
])
def test_arm_names_are_unique_and_safe_as_file_names_before_any_work(tmp_path, arms, says):
    path = tmp_path / 'names.py'
    path.write_text(f"out_dir = {str(tmp_path / 'sweep')!r}\nbase = {TINY!r}\nmax_steps = 8\nchunks = 2\narms = {arms}\n")
    r = run(str(path))
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and says in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / 'sweep')
