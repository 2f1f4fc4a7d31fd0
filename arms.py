"""
The arms of a sweep (sweep.py): read from a sweep file, each a train.py run's settings,
checked before any arm starts; and the stop / resume / clone commands that change them.

A sweep file sets `out_dir`; `config` (a train.py config file, optional) and `base`
({setting: value}) for every arm; `max_steps` and `chunks`; `arms` ({name: {setting:
value}}) or a `grid` ({setting: [values]}, an arm per combination); and `halving`.
"""
import ast
import copy
import functools
import itertools
import json
import os
import re
import runpy
import subprocess
import sys

import checkpoint
from configurator import configure

ROOT = os.path.dirname(os.path.abspath(__file__))
REQUIRED = {'out_dir': str, 'max_steps': int, 'chunks': int}  # the sweep's, for every arm
# an arm's name is its folder's and, with .stderr, its log's: no slash, no control
# character, no leading '.' or '-', at most 200 characters, none of the sweep's own files
SAFE_NAME = re.compile(r'[^./\\\x00-\x1f\x7f-][^/\\\x00-\x1f\x7f]{0,199}')
SWEEP_FILES = ('sweep.json', 'sweep.jsonl', 'sweep.svg', 'control.jsonl')


@functools.cache  # train.py is asked once per sweep, not once per arm
def defaults():
    """train.py's settings with their defaults, and their ranges, as `train.py --check`
    prints them."""
    check = [sys.executable, os.path.join(ROOT, 'train.py'), '--check']
    r = subprocess.run(check, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"error: train.py --check failed: {r.stderr.strip()}")
    resolved = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    return resolved['settings'], resolved['ranges']


def checked(arm, args):
    """train.py's arguments `args`, checked as train.py checks them; an error names the arm."""
    if not SAFE_NAME.fullmatch(arm) or arm.endswith('.stderr') or arm in SWEEP_FILES:
        raise SystemExit(f"error: arm {arm!r}: an arm's name is its folder's; rename it "
                         f"without '/', '\\' or control characters, not starting with '.' "
                         f"or '-', not ending in .stderr, not one of {', '.join(SWEEP_FILES)}")
    try:
        settings, ranges = defaults()
        configure(dict(settings), args, ranges)  # a copy: configure fills it in
    except SystemExit as e:
        raise SystemExit(f"error: arm {arm!r}: {str(e).removeprefix('error: ')}") from None
    return args


def arguments(overrides):
    """{setting: value} as train.py's --key=value arguments."""
    return [f'--{k}={v}' if isinstance(v, str) else f'--{k}={v!r}'
            for k, v in overrides.items()]


def named_twice(path):
    """The keys written twice in a sweep file's `arms = {...}` (Python keeps the last one
    of a dict literal without a word)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    twice = []
    for node in tree.body:
        targets = [t.id for t in getattr(node, 'targets', []) if isinstance(t, ast.Name)]
        if targets == ['arms'] and isinstance(node.value, ast.Dict):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            twice += sorted({k for k in keys if keys.count(k) > 1})
    return twice


def new_sweep(path):
    """The state of the sweep a sweep file describes, every arm's arguments checked."""
    try:
        spec = runpy.run_path(path)
    except Exception as e:  # its own mistake, in one line
        raise SystemExit(f"error: sweep file {path}: {type(e).__name__}: {e}; fix it") from None
    arms = spec.get('arms') or {}
    grid = spec.get('grid') or {}
    named_settings = isinstance(arms, dict) and all(isinstance(a, dict) for a in arms.values())
    if not named_settings or not isinstance(grid, dict) or \
            not all(isinstance(v, (list, tuple)) for v in grid.values()):
        raise SystemExit(f"error: {path}: arms must be {{name: {{setting: value}}}} and grid "
                         f"{{setting: [values]}}")
    twice = named_twice(path)
    for values in itertools.product(*grid.values()) if grid else ():
        combo = dict(zip(grid, values))
        name = '_'.join(f'{k}={v}' for k, v in combo.items())
        twice += [name] if name in arms else []
        arms[name] = combo
    if twice:
        raise SystemExit(f"error: {path}: the arm {twice[0]!r} is named twice (an arm of "
                         f"the grid counts too); give every arm its own name")
    settings = [spec.get('base', {})] + list(arms.values())
    for key, kind in REQUIRED.items():
        if type(spec.get(key)) is not kind or any(key in s for s in settings):
            raise SystemExit(f"error: {path}: set {key} ({kind.__name__}) at the top of "
                             f"the sweep file, once for every arm, not in base or an arm")
    if not arms or not 0 < spec['chunks'] <= spec['max_steps']:
        raise SystemExit(f"error: {path}: name arms or a grid; 0 < chunks <= max_steps")
    # train.py runs in the repository: paths are relative to it, out_dir made absolute
    config = [spec['config']] if spec.get('config') else []
    base = checked('base', config + arguments(spec.get('base', {})))
    arms = {name: dict(args=arguments(o), done=0, status='running', parent=None, seconds=0.0)
            for name, o in arms.items()}
    for name, arm in arms.items():
        checked(name, base + arm['args'])
    return dict(dir=os.path.abspath(spec['out_dir']), base=base, arms=arms,
                max_steps=spec['max_steps'], chunks=spec['chunks'],
                halving=spec.get('halving', False), halved=[], commands=0)


def command(state, words):
    """Apply one control command (stop, resume, clone) to the state."""
    if len(words) < 2:
        raise SystemExit(f"error: {' '.join(words)}: name an arm, as in {words[0]} ARM")
    verb, name, rest = words[0], words[1], words[2:]
    arms = state['arms']
    if verb not in ('stop', 'resume', 'clone') or name not in arms:
        raise SystemExit(f"error: {verb} {name}: choose stop, resume or clone, "
                         f"and an arm among {sorted(arms)}")
    if verb == 'clone':
        if not rest or rest[0] in arms or not all(a.startswith('--') for a in rest[1:]):
            raise SystemExit(f"error: clone {name} NEW --key=value ...: NEW is a new name")
        args = arms[name]['args'] + rest[1:]  # later arguments win
        checked(rest[0], state['base'] + args)
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
        try:
            words = json.loads(line)
        except json.JSONDecodeError:  # cut off by a crash mid-write: it never came
            print(f"warning: {path}: dropped the cut-off line {line!r}; queue that "
                  f"command again", file=sys.stderr)
            continue
        try:  # queue_command checked it; a line written by hand may be anything
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise SystemExit(f"{line!r} is no list of words")
            command(state, words)
        except SystemExit as e:
            print(f"warning: {path}: dropped the command {line!r} "
                  f"({str(e).removeprefix('error: ')})", file=sys.stderr)
    state['commands'] = len(lines)


def queue_command(state, words):
    """Check a command now, against the state as the sweep will see it, and queue it in
    DIR/control.jsonl for the sweep to apply before its next chunk."""
    ahead = copy.deepcopy(state)  # with the queued commands applied
    apply_commands(ahead)
    command(ahead, words)
    path = os.path.join(state['dir'], 'control.jsonl')
    cut = os.path.exists(path) and open(path).read()[-1:] not in ('', '\n')
    with open(path, 'a') as f:  # on a line of its own, after a cut-off one too
        f.write(('\n' if cut else '') + json.dumps(words) + '\n')


def table(state):
    """One row per arm from its log: steps, tokens, train and val loss, best val."""
    rows = []
    for name, arm in state['arms'].items():
        path = os.path.join(state['dir'], name, 'log.jsonl')
        recs = checkpoint.read_log(path) if os.path.exists(path) else []
        vals = [(r['tokens'], r['val_loss']) for r in recs if 'val_loss' in r]
        last = recs[-1] if recs else {}
        rows.append(dict(arm=name, step=last.get('step', 0),
                         tokens=last.get('tokens', 0), loss=last.get('loss'),
                         val_loss=vals[-1][1] if vals else None,
                         best_val=min(v for _, v in vals) if vals else None,
                         minutes=arm['seconds'] / 60, status=arm['status'], curve=vals))
    return rows
