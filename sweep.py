"""
Many training configurations ("arms") side by side, trained in chunks so that they all
advance together and the first comparison comes early (docs/sweeps.md):

    python sweep.py sweeps/lr.py [--workers=N]  # start the sweep a file describes, or go on
    python sweep.py DIR [--workers=N]           # go on with the sweep in DIR (after a kill too)
    python sweep.py DIR stop ARM                # between chunks: stop an arm,
    python sweep.py DIR resume ARM              # ... let a stopped arm go on,
    python sweep.py DIR clone ARM NEW --learning_rate=1e-3   # ... or branch it

Each arm is a train.py run in DIR/ARM. Its chunk c is that run resumed and stopped at step
max_steps * c / chunks (--stop_after), its schedules still laid over max_steps, so chunks
change nothing the arm computes. The arm with the fewest chunks done goes next, the first
named on a tie; N workers train N arms at a time, one GPU each where there are GPUs. A
killed sweep redoes only the chunks in flight.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import torch

import checkpoint
from arms import apply_commands, new_sweep, queue_command, table
from configurator import configure, words
from report import write_svg
from run_state import hold

ROOT = os.path.dirname(os.path.abspath(__file__))
MINE = '.sweep_arm'  # the mark of an arm's folder this sweep made: no other is ever removed


def next_arm(state, busy):
    """The running arm not in flight with the fewest chunks done, the first named on a tie.
    Under halving no arm gets a chunk ahead, so that each halving ranks every arm."""
    running = [(a['done'], i, n) for i, (n, a) in enumerate(state['arms'].items())
               if a['status'] == 'running']
    free = [r for r in running if r[2] not in busy]
    if not free or (state['halving'] and min(free)[0] > min(running)[0]):
        return None
    return min(free)[2]


def halve(state, val):
    """Successive halving: once every running arm has done k chunks (k < chunks, not
    halved at k before), the worse half by val loss stops."""
    running = [n for n, a in state['arms'].items() if a['status'] == 'running']
    done = {state['arms'][n]['done'] for n in running}
    k = done.pop() if len(done) == 1 else 0
    if 0 < k < state['chunks'] and k not in state['halved'] and len(running) > 1:
        state['halved'].append(k)
        for name in sorted(running, key=lambda n: val[n])[(len(running) + 1) // 2:]:
            state['arms'][name]['status'] = 'halved'


def worker_env(slot, workers):
    """A worker's environment: one GPU each where there are GPUs, else a share of the cores."""
    env = dict(os.environ)
    gpus = [str(i) for i in range(torch.cuda.device_count())]
    gpus = env.get('CUDA_VISIBLE_DEVICES', ','.join(gpus)).split(',') if gpus else []
    if gpus:
        env['CUDA_VISIBLE_DEVICES'] = gpus[slot % len(gpus)]
    elif workers > 1:
        env.setdefault('OMP_NUM_THREADS', str(max(1, os.cpu_count() // workers)))
    return env


def fresh_folder(folder):
    """An empty arm folder, marked as this sweep's. One that holds no checkpoint is
    emptied only when this sweep made it and holds nothing set aside (damaged_*): else
    the arm fails in one line and nothing is removed."""
    if os.path.lexists(folder):
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if MINE not in names or os.path.islink(folder):
            raise ValueError(f"{folder} exists and was not made by this sweep; "
                             "move it away or rename the arm")
        if any(n.startswith('damaged_') for n in names):
            raise ValueError(f"{folder} holds only set-aside checkpoints (damaged_*); "
                             "move them away to train the arm from its start again")
        shutil.rmtree(folder)
    os.makedirs(folder)
    open(os.path.join(folder, MINE), 'w').close()


def start_chunk(state, name, env):
    """Start arm `name`'s next chunk: its run resumed (or started) in a process that stops
    at the chunk's end. None if the chunk is saved already (a sweep killed just after), or
    if its folder cannot be its own (the arm fails, see fresh_folder)."""
    arm, M, n = state['arms'][name], state['max_steps'], state['chunks']
    folder = os.path.join(state['dir'], name)
    end = M * (arm['done'] + 1) // n
    if os.path.lexists(folder) and not os.path.isfile(os.path.join(folder, MINE)):
        arm['status'] = f"failed: {folder} exists and was not made by this sweep"
        print(f"error: arm {name}: {folder} exists and was not made by this sweep; move it "
              f"away or rename the arm", file=sys.stderr)
        return None
    saved = checkpoint.checkpoints(folder)
    if saved and int(os.path.basename(saved[-1])[5:]) >= end:
        return None
    if saved:
        start = ['--init_from=resume']
    else:
        try:
            fresh_folder(folder)  # a start killed before its first save leaves its own
        except (OSError, ValueError) as e:
            arm['status'] = f'failed: {e}'
            print(f"error: arm {name}: {e}", file=sys.stderr)
            return None
        parent = arm['parent']
        start = [f"--init_from={os.path.join(state['dir'], parent)}"] if parent else []
    cmd = [sys.executable, 'train.py', *state['base'], *arm['args'],
           f'--out_dir={folder}', f'--max_steps={M}', f'--stop_after={end % M}',  # 0: M
           '--sample.tokens=0', *start]
    errors = open(os.path.join(state['dir'], f'{name}.stderr'), 'w')
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors, env=env)


def finish_chunk(state, name, code):
    """Count a finished chunk, or mark the arm failed with train.py's last error line."""
    arm = state['arms'][name]
    if arm['status'].startswith('failed'):  # it never started (start_chunk)
        return
    if code:
        with open(os.path.join(state['dir'], f'{name}.stderr')) as f:
            arm['status'] = 'failed: ' + (f.read().strip().splitlines() or ['?'])[-1]
        return
    arm['done'] += 1
    if arm['status'] == 'running':  # not stopped while in flight
        arm['status'] = 'done' if arm['done'] == state['chunks'] else 'running'


def report(state, rows):
    """The table on the console and in sweep.jsonl; the val curves in sweep.svg."""
    print(f"{'arm':>24} {'step':>6} {'tokens':>10} {'loss':>8} {'val':>8} "
          f"{'best val':>8} {'minutes':>7}  status")
    for r in rows:
        cells = [f'{r[k]:8.4f}' if r[k] is not None else f"{'-':>8}"
                 for k in ('loss', 'val_loss', 'best_val')]
        print(f"{r['arm']:>24} {r['step']:>6} {r['tokens']:>10,} {' '.join(cells)} "
              f"{r['minutes']:7.1f}  {r['status']}")
    with open(os.path.join(state['dir'], 'sweep.jsonl'), 'a') as f:
        rows_without_curves = [{k: v for k, v in r.items() if k != 'curve'} for r in rows]
        f.write(json.dumps(rows_without_curves) + '\n')
    curves = {r['arm']: tuple(zip(*r['curve'])) for r in rows if r['curve']}
    if curves:
        lows, highs = zip(*[(min(ys), max(ys)) for _, ys in curves.values()])
        write_svg(os.path.join(state['dir'], 'sweep.svg'), curves,
                  f'val loss ({min(lows):.3f} to {max(highs):.3f}) against tokens')


def main(argv):
    plain = [i for i, a in enumerate(argv) if not a.startswith('--')]
    at = plain[1] if len(plain) > 1 else len(argv)  # a command from the second word on
    where, options = words(argv[:at])
    workers = configure({'workers': 1}, options, {'workers': 'positive'})['workers']
    if not where:
        raise SystemExit("usage: python sweep.py SWEEP_FILE | DIR [--workers=N, N >= 1] "
                         "| DIR stop|resume|clone ARM ...")
    state = new_sweep(where[0]) if os.path.isfile(where[0]) else None
    path = os.path.join(state['dir'] if state else where[0], 'sweep.json')
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)  # a sweep under way carries on
    if state is None:
        raise SystemExit(f"error: {where[0]!r} is no sweep file and no sweep's folder")
    if argv[at:]:
        if not os.path.exists(path):
            raise SystemExit(f"error: the sweep {where[0]} has not started; start it with "
                             f"python sweep.py {where[0]}, then send {argv[at]}")
        queue_command(state, argv[at:])
    else:
        run(state, path, workers)


def save(state, path):
    with open(path + '.tmp', 'w') as f:
        json.dump(state, f)
    os.replace(path + '.tmp', path)  # a kill leaves the old state or the new one


def run(state, path, workers):
    """Chunks until no arm is left running, `workers` at a time; the state saved and the
    table reported after each."""
    os.makedirs(state['dir'], exist_ok=True)
    lock = hold(state['dir'])  # one sweep.py at a time runs a sweep, until it ends
    if lock is None:
        raise SystemExit(f"error: the sweep in {state['dir']} is running in another process; "
                         f"wait for it, or send it a command (python sweep.py {state['dir']} "
                         f"stop ARM)")
    save(state, path)  # from the start, `sweep.py DIR stop ARM` finds the sweep
    flight = {}  # arm -> (its train.py process, worker slot, start time)
    while True:
        apply_commands(state)
        while len(flight) < workers and (name := next_arm(state, flight)):
            slot = min(set(range(workers)) - {s for _, s, _ in flight.values()})
            process = start_chunk(state, name, worker_env(slot, workers))
            flight[name] = (process, slot, time.time())
        if not flight:
            break
        ended = [n for n, (p, _, _) in flight.items() if p is None or p.poll() is not None]
        if not ended:
            time.sleep(0.2)
            continue
        for name in ended:
            process, _, started = flight.pop(name)
            state['arms'][name]['seconds'] += time.time() - started
            finish_chunk(state, name, process.returncode if process else 0)
        if state['halving']:
            halve(state, {r['arm']: r['val_loss'] for r in table(state)})
        save(state, path)
        report(state, table(state))


if __name__ == '__main__':
    main(sys.argv[1:])
