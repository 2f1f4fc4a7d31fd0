"""teach.py: a teacher's own text (LLM-QAT style) and its answers to prompts, written as token shards
that equal what engine.rollout samples for each document alone from the same seed, and that train.py
trains on."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data import read_shard, shard_paths
from engine import rollout
from model import ModelConfig, Transformer
from tokenizer import chat_prompt, get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp('teacher')
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=320, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96,
                            max_seq_len=256)).save_pretrained(path)
    return str(path)


def teach(*args):
    return subprocess.run([sys.executable, 'teach.py', *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def tokens(folder, split):
    return np.concatenate([read_shard(p) for p in shard_paths(folder, split)]).tolist()


def masks(folder, split):
    return np.concatenate([read_shard(p[:-4] + '.mask') for p in shard_paths(folder, split)]).tolist()


def answer_mask(start, document):
    """0 on the prompt's tokens, 1 on what was sampled after them."""
    return [0] * len(start) + [1] * (len(document) - len(start))


def alone(model, start, new_tokens, seed, greedy=0, stop_ids=()):
    """One document as engine samples it by itself: the greedy tokens, then the sampled ones."""
    if greedy:
        x, valid, _, _ = rollout(model, [start], greedy, temperature=0, vocab=260)
        start = x[0][valid[0]].tolist()
    x, valid, _, _ = rollout(model, [start], new_tokens - greedy, stop_ids=stop_ids, seeds=[seed], vocab=260)
    return x[0][valid[0]].tolist()


def test_its_own_text_is_what_each_document_samples_alone_and_depends_on_the_seed_only(teacher, tmp_path):
    args = [f'--ckpt={teacher}', '--tokens=600', '--length=40', '--greedy=4', '--batch_size=3']
    r = teach(*args, f'--out={tmp_path / "a"}')
    assert r.returncode == 0, r.stderr
    assert 'wrote' in r.stdout
    model = Transformer.from_pretrained(teacher).eval()
    ordinary = list(range(256))  # the byte tokens; 256-259 are special, 260+ padding rows
    expected = {'train': [], 'val': []}
    with torch.no_grad():
        for split, seeds in (('train', range(1337, 1337 + 15)), ('val', [1337 + 10 ** 6])):
            for s in seeds:
                first = torch.randint(len(ordinary), (1,), generator=torch.Generator().manual_seed(s)).item()
                expected[split] += alone(model, [256, ordinary[first]], 38, s, greedy=4)
    assert tokens(tmp_path / 'a', 'train') == expected['train'] and len(expected['train']) == 15 * 40
    assert tokens(tmp_path / 'a', 'val') == expected['val']
    assert json.load(open(tmp_path / 'a' / 'prepared.json'))['tokenizer'] == 'bytes'
    assert not list((tmp_path / 'a').glob('*.mask'))  # its own text counts everywhere
    assert teach(*args, f'--out={tmp_path / "b"}').returncode == 0
    assert teach(*args, f'--out={tmp_path / "c"}', '--seed=7').returncode == 0
    assert tokens(tmp_path / 'b', 'train') == expected['train'] != tokens(tmp_path / 'c', 'train')
    r = teach(*args, f'--out={tmp_path / "a"}')  # never over shards already there
    assert r.returncode == 1 and 'already holds token shards' in r.stderr and r.stderr.count('\n') == 1


def test_answers_to_prompts_hold_out_every_tenth_prompt_and_train_py_reads_them(teacher, tmp_path):
    lines = [f'Question {i}: what is {i} plus {i}?' for i in range(11)]
    lines[3] = json.dumps({'messages': [{'role': 'system', 'content': 'Be brief.'},
                                        {'role': 'user', 'content': 'Name a colour.'},
                                        {'role': 'assistant', 'content': 'Red.'}]})
    lines[5] = json.dumps({'prompt': 'What is 2 plus 2?', 'answer': '4'})  # a task's problem, as rl.py's files
    prompts = tmp_path / 'prompts.txt'
    prompts.write_text('\n'.join(lines) + '\n')
    out = tmp_path / 'answers'
    r = teach(f'--ckpt={teacher}', f'--out={out}', f'--prompts={prompts}', '--max_answer=24', '--batch_size=4')
    assert r.returncode == 0, r.stderr
    enc, model = get_tokenizer('bytes'), Transformer.from_pretrained(teacher).eval()
    turns = [[('user', line)] for line in lines]
    turns[3] = [('system', 'Be brief.'), ('user', 'Name a colour.')]  # up to the first answer
    turns[5] = [('user', 'What is 2 plus 2?')]  # its prompt alone
    stop = (enc.encode_single_token('<|im_end|>'), 256)
    with torch.no_grad():
        train = [alone(model, chat_prompt(enc, t), 24, 1337 + i, stop_ids=stop)
                 for i, t in enumerate(turns[:9] + turns[10:])]
        val = alone(model, chat_prompt(enc, turns[9]), 24, 1337 + 10 ** 6, stop_ids=stop)
    assert tokens(out, 'train') == sum(train, []) and tokens(out, 'val') == val
    starts = [chat_prompt(enc, t) for t in turns[:9] + turns[10:]]
    assert masks(out, 'train') == sum(map(answer_mask, starts, train), [])  # the loss on the answers alone
    assert masks(out, 'val') == answer_mask(chat_prompt(enc, turns[9]), val)
    assert 0 < sum(masks(out, 'train')) < len(masks(out, 'train'))
    r = teach(f'--ckpt={teacher}', f'--out={tmp_path / "all"}', f'--prompts={prompts}', '--max_answer=24',
              '--batch_size=4', '--prompt_loss=True')  # the loss on every token: no mask, the same tokens
    assert r.returncode == 0 and not list((tmp_path / 'all').glob('*.mask')) and tokens(tmp_path / 'all', 'train') == sum(train, [])
    assert b'Question 9' in enc.decode_bytes(val) and b'Question 9' not in enc.decode_bytes(sum(train, []))
    r = subprocess.run([sys.executable, 'train.py', f'--dataset={out}', '--tokenizer=bytes', f'--init_from={teacher}',
                        '--bitnet=True', '--max_steps=2', '--batch_size=2', '--block_size=32', '--eval_interval=2',
                        '--eval_iters=1', '--sample.tokens=0', f'--out_dir={tmp_path / "student"}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    prompts.write_text('\n'.join(lines[:9]) + '\n')
    r = teach(f'--ckpt={teacher}', f'--out={tmp_path / "few"}', f'--prompts={prompts}')
    assert r.returncode == 1 and 'at least 10' in r.stderr and r.stderr.count('\n') == 1
    assert not os.path.exists(tmp_path / 'few')
