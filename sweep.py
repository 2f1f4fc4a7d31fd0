"""
Many training configurations ("arms") side by side on one machine, trained in chunks
so that they all advance together and the first comparison comes early:

    python sweep.py sweeps/lr.py      # start the sweep a file describes, or carry it on
    python sweep.py DIR               # carry on the sweep in DIR (after a kill too)
    python sweep.py DIR stop ARM      # between two chunks: stop an arm,
    python sweep.py DIR resume ARM    # ... let a stopped arm go on,
    python sweep.py DIR clone ARM NEW --learning_rate=1e-3   # ... or branch it

A sweep file sets `out_dir`, `config` (a train.py config file, optional) and `base`
(settings) for every arm,
`max_steps`, `chunks`, `arms` ({name: {setting: value}}) or a `grid` ({setting:
[values]}, an arm per combination), and `halving` (successive halving: each time every
running arm has done as many chunks, the worse half by val loss stops). Each arm is a
train.py run in DIR/ARM; its chunk c is that run resumed and stopped at step max_steps
* c / chunks (`--stop_after`), the schedules still laid over max_steps, so chunks
change nothing an arm computes. The arm with the fewest chunks done goes next, the
first named on a tie. A clone starts from its parent's newest checkpoint (weights
only). Commands go to DIR/control.jsonl, applied before the next chunk. A killed sweep
(its process group, as Ctrl-C) redoes only the chunk in flight, from the arm's newest
checkpoint. After each chunk the table (steps, tokens, train and val loss, best val,
status) is printed and appended to DIR/sweep.jsonl; DIR/sweep.svg plots val loss per
arm.
"""
import ast
import copy
import itertools
import json
import os
import runpy
import shutil
import subprocess
import sys
import time

import checkpoint

ROOT = os.path.dirname(os.path.abspath(__file__))
COLORS = ('black', 'red', 'blue', 'green', 'orange', 'purple', 'brown', 'gray')


def setting_names():
    """train.py's settings: the names assigned between its two rulers."""
    names, inside = set(), False
    for node in ast.parse(open(os.path.join(ROOT, 'train.py')).read()).body:
        assigned = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
        if 'config' in assigned:
            return names
        names |= assigned if inside else set()
        inside = inside or '_imported' in assigned


def arguments(arm, overrides):
    """--key=value arguments for train.py; an unknown key names the arm and the key."""
    if not arm or os.sep in arm or arm.startswith('.'):
        raise SystemExit(f"error: arm {arm!r}: an arm's name is its folder's")
    unknown = sorted(set(overrides) - setting_names())
    if unknown:
        raise SystemExit(f"error: arm {arm!r}: unknown setting {unknown[0]!r}")
    return [f'--{k}={v}' if isinstance(v, str) else f'--{k}={v!r}'
            for k, v in overrides.items()]


def new_sweep(path):
    """The state of the sweep a sweep file describes, every arm's arguments checked."""
    spec = runpy.run_path(path)
    arms = spec.get('arms') or {}
    grid = spec.get('grid') or {}
    for values in itertools.product(*grid.values()) if grid else ():
        combo = dict(zip(grid, values))
        arms['_'.join(f'{k}={v}' for k, v in combo.items())] = combo
    if not arms or not 0 < spec['chunks'] <= spec['max_steps']:
        raise SystemExit(f"error: {path}: name arms or a grid; 0 < chunks <= max_steps")
    arms = {name: dict(args=arguments(name, o), done=0, status='running', parent=None,
                       seconds=0.0) for name, o in arms.items()}
    # train.py runs in the repository: base's paths are relative to it, out_dir made absolute
    config = [spec['config']] if spec.get('config') else []  # a train.py config file
    base = config + arguments('base', spec.get('base', {}))
    return dict(dir=os.path.abspath(spec['out_dir']), base=base, arms=arms,
                max_steps=spec['max_steps'], chunks=spec['chunks'],
                halving=spec.get('halving', False), halved=[], commands=0)


def command(state, words):
    """Apply one control command (stop, resume, clone) to the state."""
    verb, name, rest = words[0], words[1], words[2:]
    arms = state['arms']
    if verb not in ('stop', 'resume', 'clone') or name not in arms:
        raise SystemExit(f"error: {verb} {name}: choose stop, resume or clone, "
                         f"and an arm among {sorted(arms)}")
    if verb == 'clone':
        if not rest or rest[0] in arms or not all(a.startswith('--') for a in rest[1:]):
            raise SystemExit(f"error: clone {name} NEW --key=value ...: NEW is a new name")
        arguments(rest[0], dict.fromkeys(a[2:].partition('=')[0] for a in rest[1:]))
        args = arms[name]['args'] + rest[1:]  # later arguments win
        arms[rest[0]] = dict(args=args, done=0, status='running', parent=name, seconds=0.0)
    elif verb == 'stop':
        arms[name]['status'] = 'stopped'
    else:
        finished = arms[name]['done'] == state['chunks']
        arms[name]['status'] = 'done' if finished else 'running'


def apply_commands(state):
    """The commands of DIR/control.jsonl that the state has not seen yet."""
    path = os.path.join(state['dir'], 'control.jsonl')
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    for line in lines[state['commands']:]:
        command(state, json.loads(line))
    state['commands'] = len(lines)


def next_arm(arms):
    """The running arm with the fewest chunks done; the first named on a tie."""
    running = [(a['done'], i, n) for i, (n, a) in enumerate(arms.items())
               if a['status'] == 'running']
    return min(running)[2] if running else None


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


def run_chunk(state, name):
    """Train arm `name`'s next chunk: its run resumed (or started), stopped at the
    chunk's end."""
    arm, M, n = state['arms'][name], state['max_steps'], state['chunks']
    folder = os.path.join(state['dir'], name)
    end = M * (arm['done'] + 1) // n
    saved = checkpoint.checkpoints(folder)
    if saved:
        start = ['--init_from=resume']
    else:
        shutil.rmtree(folder, ignore_errors=True)  # a start killed before its first save
        parent = arm['parent']
        start = [f"--init_from={os.path.join(state['dir'], parent)}"] if parent else []
    # a sweep killed between the chunk's last save and its own finds the chunk done
    if not saved or int(os.path.basename(saved[-1])[5:]) < end:
        cmd = [sys.executable, 'train.py', *state['base'], *arm['args'],
               f'--out_dir={folder}', f'--max_steps={M}', f'--stop_after={end % M}',  # 0: M
               '--sample_tokens=0', *start]
        started = time.time()
        r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        arm['seconds'] += time.time() - started
        if r.returncode:
            arm['status'] = 'failed: ' + (r.stderr.strip().splitlines() or ['?'])[-1]
            return
    arm['done'] += 1
    arm['status'] = 'done' if arm['done'] == n else 'running'


def table(state):
    """One row per arm from its log: steps, tokens, train and val loss, best val."""
    rows = []
    for name, arm in state['arms'].items():
        path = os.path.join(state['dir'], name, 'log.jsonl')
        recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        vals = [(r['tokens'], r['val_loss']) for r in recs if 'val_loss' in r]
        last = recs[-1] if recs else {}
        rows.append(dict(arm=name, step=last.get('step', 0),
                         tokens=last.get('tokens', 0), loss=last.get('loss'),
                         val_loss=vals[-1][1] if vals else None,
                         best_val=min(v for _, v in vals) if vals else None,
                         minutes=arm['seconds'] / 60, status=arm['status'], curve=vals))
    return rows


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
    points = [p for r in rows for p in r['curve']]
    if points:
        write_svg(os.path.join(state['dir'], 'sweep.svg'), rows, points)


def write_svg(path, rows, points, W=560, H=320):
    """Each arm's val loss against tokens, one colour per arm."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    px = lambda x: 50 + (x - min(xs)) / (max(xs) - min(xs) or 1) * (W - 220)
    py = lambda y: H - 30 - (y - min(ys)) / (max(ys) - min(ys) or 1) * (H - 60)
    parts = []
    for i, (row, color) in enumerate(zip(rows, itertools.cycle(COLORS))):
        line = ' '.join(f'{px(x):.1f},{py(y):.1f}' for x, y in row['curve'])
        parts.append(f'<polyline fill="none" stroke="{color}" points="{line}"/>'
                     f'<text x="{W - 160}" y="{30 + 14 * i}" font-size="11" '
                     f'fill="{color}">{row["arm"]}</text>')
    with open(path, 'w') as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
                '<rect width="100%" height="100%" fill="white"/>' + ''.join(parts)
                + f'<text x="50" y="15" font-size="11">val loss ({min(ys):.3f} to '
                f'{max(ys):.3f}) against tokens ({min(xs):,} to {max(xs):,})</text></svg>')


def main(argv):
    if not argv:
        raise SystemExit("usage: python sweep.py SWEEP_FILE | DIR [stop|resume|clone]")
    state = new_sweep(argv[0]) if os.path.isfile(argv[0]) else None
    path = os.path.join(state['dir'] if state else argv[0], 'sweep.json')
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)  # a sweep under way carries on
    if state is None:
        raise SystemExit(f"error: {argv[0]!r} is no sweep file and no sweep's folder")
    if len(argv) > 1:  # a command: checked now, applied before the sweep's next chunk
        ahead = copy.deepcopy(state)  # with the commands not applied yet
        apply_commands(ahead)
        command(ahead, argv[1:])
        with open(os.path.join(state['dir'], 'control.jsonl'), 'a') as f:
            f.write(json.dumps(argv[1:]) + '\n')
        return
    os.makedirs(state['dir'], exist_ok=True)
    while True:
        apply_commands(state)
        name = next_arm(state['arms'])
        if name is None:
            break
        run_chunk(state, name)
        if state['halving']:
            halve(state, {r['arm']: r['val_loss'] for r in table(state)})
        with open(path + '.tmp', 'w') as f:
            json.dump(state, f)
        os.replace(path + '.tmp', path)  # a kill leaves the old state or the new one
        report(state, table(state))


if __name__ == '__main__':
    main(sys.argv[1:])
