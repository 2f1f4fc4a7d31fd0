"""GRPO: the loss against the formulas computed token by token in plain Python, its gradient
against the hand-derived one, the rollouts (KV cache, padding, recorded log-probabilities), the
rewards, the prompt files and the offline task."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

import engine
import rl
from model import ModelConfig, Transformer
from objectives import GRPO, grpo_loss, group_advantages, token_logprobs
from tokenizer import chat_prompt, get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--arch.n_layer=2', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64', '--eval_iters=2',
        '--log_interval=1', '--sample.tokens=0', '--warmup_steps=2']


def log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 0.5, 0.5, 0.5]  # two groups of 4; the second is all 0.5
    r = torch.tensor(rewards)
    first, second = rewards[:4], rewards[4:]
    want_group, want_none, want_batch = [], [], []
    for g in (first, second):
        mean, std = statistics.mean(g), statistics.stdev(g)
        want_none += [x - mean for x in g]
        want_group += [(x - mean) / (std + 1e-4) for x in g]
    batch_std = statistics.stdev(rewards)
    want_batch = [a / (batch_std + 1e-4) for a in want_none]
    assert torch.allclose(group_advantages(r, 4, 'group'), torch.tensor(want_group), atol=1e-6)
    assert torch.allclose(group_advantages(r, 4, 'batch'), torch.tensor(want_batch), atol=1e-6)
    assert torch.allclose(group_advantages(r, 4, 'none'), torch.tensor(want_none), atol=1e-6)
    equal = group_advantages(torch.full((4,), 0.5), 4, 'group')
    assert torch.equal(equal, torch.zeros(4))  # zero, not NaN
    with pytest.raises(ValueError, match='scale_rewards'):
        group_advantages(r, 4, 'std')


def by_hand(logp, old, ref, A, mask, eps_low, eps_high, beta, aggregation, max_len, active):
    """The GRPO loss, token by token in floats."""
    B, L = len(logp), len(logp[0])
    per_token = [[0.0] * L for _ in range(B)]
    for b in range(B):
        for t in range(L):
            rho = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            value = -min(rho * A[b], clipped * A[b])
            if beta:
                d = ref[b][t] - logp[b][t]
                value += beta * (math.exp(d) - d - 1)
            per_token[b][t] = value * mask[b][t]
    total = sum(map(sum, per_token))
    if aggregation == 'grpo':
        return sum(sum(row) / max(sum(m), 1) for row, m in zip(per_token, mask)) / B
    if aggregation == 'bnpo':
        return total / sum(map(sum, mask))
    if aggregation == 'dr_grpo':
        return total / (B * max_len)
    return total / active


def grad_by_hand(logp, old, ref, A, mask, eps_low, eps_high, beta, aggregation, max_len, active):
    """d loss / d logp: -A rho where the unclipped term is the minimum (0 where the clip
    holds), plus beta (1 - exp(ref - logp)), times each token's weight in the aggregation."""
    B, L = len(logp), len(logp[0])
    N = sum(map(sum, mask))
    grad = [[0.0] * L for _ in range(B)]
    for b in range(B):
        for t in range(L):
            rho = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            g = -A[b] * rho if rho * A[b] <= clipped * A[b] else 0.0
            if beta:
                g += beta * (1 - math.exp(ref[b][t] - logp[b][t]))
            weight = {'grpo': 1 / (B * max(sum(mask[b]), 1)), 'bnpo': 1 / N,
                      'dr_grpo': 1 / (B * max_len), 'dapo': 1 / active}[aggregation]
            grad[b][t] = g * weight * mask[b][t]
    return grad


@pytest.mark.parametrize('aggregation', ['grpo', 'bnpo', 'dr_grpo', 'dapo'])
@pytest.mark.parametrize('beta', [0.0, 0.04])
@pytest.mark.parametrize('reused', [False, True])
def test_grpo_loss_and_gradient_equal_the_formulas(aggregation, beta, reused):
    g = torch.Generator().manual_seed(0)
    B, L = 4, 6
    logp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    # a batch used a second time: the policy moved since sampling, by up to +-0.5 in log space,
    # so that rho leaves [0.8, 1.2] on both sides, for advantages of both signs
    old = logp.detach().clone()
    if reused:
        old = old + torch.linspace(-0.5, 0.5, B * L, dtype=torch.float64).view(B, L)
    ref = logp + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    A = torch.tensor([1.5, -0.7, 0.0, -1.2], dtype=torch.float64)
    mask = torch.ones(B, L)
    mask[0, 4:] = 0  # stopped early: padding after its stop token
    mask[2, 1:] = 0
    # rows 1 and 3 run to the length limit (no stop token)
    logp.requires_grad_(True)
    active = 17.5
    loss, parts = grpo_loss(logp, old, ref, A, mask, 0.2, 0.28, beta, aggregation, L, active)
    loss.backward()
    args = [x.tolist() for x in (logp.detach(), old, ref, A, mask)] + [0.2, 0.28, beta, aggregation, L, active]
    assert loss.item() == pytest.approx(by_hand(*args), rel=1e-12, abs=1e-12)
    assert torch.allclose(logp.grad, torch.tensor(grad_by_hand(*args), dtype=torch.float64), atol=1e-12)
    rho = torch.exp(logp.detach() - old)
    if reused:  # clipping is active on both sides
        assert ((rho < 0.8) & (A[:, None] < 0)).any() and ((rho > 1.28) & (A[:, None] > 0)).any()
        assert 0 < parts['clipped'].sum() < B * L
    else:
        assert torch.equal(rho, torch.ones(B, L)) and parts['clipped'].sum() == 0
    assert (parts['kl'] >= 0).all() and (parts['kl'].sum() > 0) == (beta > 0)


def test_padding_changes_nothing_and_gets_no_gradient():
    B, L = 2, 5
    logp = -torch.rand(B, L)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    A = torch.tensor([1.0, -1.0])
    other = logp.clone()
    other[0, 2:] = -1e4  # whatever the model says after the stop token
    for aggregation in ('grpo', 'bnpo', 'dr_grpo', 'dapo'):
        a = logp.clone().requires_grad_(True)
        b = other.clone().requires_grad_(True)
        la = grpo_loss(a, a.detach(), a.detach() - 0.1, A, mask, beta=0.1, aggregation=aggregation,
                       max_len=L, active_tokens=7.0)[0]
        lb = grpo_loss(b, b.detach(), b.detach() - 0.1, A, mask, beta=0.1, aggregation=aggregation,
                       max_len=L, active_tokens=7.0)[0]
        la.backward()
        assert la.item() == lb.item() and math.isfinite(la.item())
        assert torch.equal(a.grad[0, 2:], torch.zeros(3)) and (a.grad[1] != 0).all()


def tiny_model(bitnet=False):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96,
                      max_seq_len=64, bitnet=bitnet, subln=bitnet)
    return Transformer(cfg).eval()


PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]


@pytest.mark.parametrize('packed', [False, True])
def test_rollout_with_a_cache_samples_what_it_samples_without(packed):
    model = tiny_model(bitnet=packed)
    if packed:
        model.freeze()
    kw = dict(temperature=1.0, top_p=0.9, stop_ids=[3], seeds=[11, 12, 13])
    x, valid, mask, logp = engine.rollout(model, PROMPTS, 16, **kw)
    x2, valid2, mask2, logp2 = engine.rollout(model, PROMPTS, 16, use_cache=False, **kw)
    assert torch.equal(x, x2) and torch.equal(mask, mask2)
    assert torch.allclose(logp, logp2, atol=1e-5)
    # the log-probabilities recorded while sampling are those of a fresh forward of the sequences
    P = x.size(1) - mask.size(1)
    with torch.no_grad():
        fresh = token_logprobs(model(x, valid=valid)[:, P - 1:-1], x[:, P:])
    assert torch.allclose(fresh * mask, logp, atol=1e-4)
    # a left-padded row samples what it samples alone
    alone = engine.rollout(model, PROMPTS[1:2], 16, temperature=1.0, top_p=0.9, stop_ids=[3], seeds=[12])
    n = alone[2].sum()
    assert torch.equal(alone[0][0, -alone[2].size(1):][:n], x[1, P:][:n]) and n == mask[1].sum()


def test_rollout_stops_rows_at_their_stop_token_and_masks_the_rest():
    model = tiny_model()
    stop = list(range(10, 64))  # most tokens stop a row: each row ends after a few
    x, valid, mask, logp = engine.rollout(model, PROMPTS, 12, stop_ids=stop, seeds=[1, 2, 3])
    P = x.size(1) - mask.size(1)
    for b in range(3):
        n = int(mask[b].sum())
        tokens = x[b, P:P + n].tolist()
        assert all(t not in stop for t in tokens[:-1]) and (tokens[-1] in stop or n == 12)
        assert mask[b, :n].all() and not mask[b, n:].any() and (logp[b, n:] == 0).all()
        assert (x[b, P + n:] == 0).all() and not valid[b, P + n:].any()
    greedy = engine.rollout(model, PROMPTS, 5, temperature=0.0)[0]
    with torch.no_grad():
        first = model(torch.tensor([PROMPTS[0]]))[0, -1].argmax()
    assert greedy[0, 6] == first


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    kept = engine.top_p_filter(probs.clone(), 0.7)  # 0.5 + 0.25 reach 0.7
    assert torch.allclose(kept, torch.tensor([[0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]]))
    assert torch.equal(engine.top_p_filter(probs.clone(), 1.0), probs)


def test_grpo_objective_is_the_loss_on_a_fresh_forward():
    """The objective's loss equals grpo_loss on the model's log-probabilities at the rollout's
    temperature; on a batch's first use rho is exactly 1 and the KL to the model itself is 0."""
    model = tiny_model()
    x, valid, mask, _ = engine.rollout(model, PROMPTS * 2, 8, temperature=0.7, seeds=range(6))
    A = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0]), 3)
    batch = {'rollouts': dict(x=x, valid=valid, mask=mask, advantages=A, max_len=8, active_tokens=9.0,
                              temperature=0.7)}
    objective = GRPO(beta=0.1, loss_type='bnpo')

    def teacher(x, y, valid):
        with torch.no_grad():
            return {'logits': model(x, valid=valid)}
    loss = objective.run(model, teacher, batch)
    P = x.size(1) - mask.size(1)
    logp = token_logprobs(model(x, valid=valid)[:, P - 1:-1] / 0.7, x[:, P:])
    want = grpo_loss(logp, logp.detach(), logp.detach(), A, mask, beta=0.1, aggregation='bnpo')[0]
    assert torch.allclose(loss, want, atol=1e-6)
    assert objective.metrics['kl'] == 0 and objective.metrics['clip_fraction'] == 0
    assert objective.metrics['entropy'] > 0
    # used again after the model moved: rho against the log-probabilities of the first use
    old = batch['rollouts']['old_logp']
    assert torch.equal(old, logp.detach())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    again = objective.run(model, teacher, batch)
    logp = token_logprobs(model(x, valid=valid)[:, P - 1:-1] / 0.7, x[:, P:])
    want = grpo_loss(logp, old, logp.detach(), A, mask, beta=0.1, aggregation='bnpo')[0]
    assert torch.allclose(again, want, atol=1e-6) and objective.metrics['clip_fraction'] > 0


def test_rewards_read_the_final_answer():
    completions = ['7 + 5 = 12\n#### 12', '#### 12.', 'It is 12.', '#### 1,200', '#### 11\nthen #### 12 more']
    assert [rl.final_answer(c) for c in completions] == ['12', '12', None, '1200', '12']
    assert rl.correct_answer([''] * 5, completions, answer=['12', '12', '12', '1200', '12']) == [1, 1, 0, 1, 1]
    assert rl.answer_format([''] * 5, completions) == [1, 1, 0, 1, 0]
    assert rl.needed_columns(rl.correct_answer) == ['answer'] and rl.needed_columns(rl.answer_format) == []


def test_the_offline_task_keeps_its_heldout_problems_out_of_training():
    heldout = rl.arithmetic_problems(200, seed=1)
    train = rl.arithmetic_problems(3000, seed=0, exclude={r['prompt'] for r in heldout})
    assert len({r['prompt'] for r in heldout}) == 200
    assert not {r['prompt'] for r in heldout} & {r['prompt'] for r in train}
    assert heldout == rl.arithmetic_problems(200, seed=1)  # made again from its seed
    for row in heldout[:50]:  # the answer is the question's: evaluate it
        question = row['prompt'].split('\n')[0]
        numbers = [int(w.strip('.?')) for w in question.split() if w.strip('.?').isdigit()]
        a, b = numbers
        ops = {'+': a + b, '-': a - b, 'times': a * b, 'more': a + b, 'away': a - b}
        op = next(k for k in ops if k in question.split() or k in question)
        assert row['answer'] == str(ops[op]), row


def test_prompt_files_with_missing_columns_or_long_prompts_are_refused(tmp_path):
    enc = get_tokenizer('bytes')
    path = tmp_path / 'p.jsonl'
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "And 2 + 2?"}\n')
    with pytest.raises(ValueError, match="lacks the column 'answer' that reward 'correct_answer'"):
        rl.read_prompts(str(path), enc, ['correct_answer'], 100)
    rows = rl.read_prompts(str(path), enc, ['format'], 100)
    assert rows[0]['tokens'] == chat_prompt(enc, 'What is 1 + 1?')
    with pytest.raises(ValueError, match="unknown reward 'length'"):
        rl.read_prompts(str(path), enc, ['length'], 100)
    n = len(chat_prompt(enc, 'What is 1 + 1?'))
    with pytest.raises(ValueError, match=f'prompt 0 .* has {n} tokens; .* holds {n - 1}'):
        rl.read_prompts(str(path), enc, ['format'], n - 1)


def prompt_file(tmp_path):
    path = tmp_path / 'prompts.jsonl'
    words = ['sun', 'tree', 'rock', 'bird', 'fish', 'moon', 'leaf', 'star']
    path.write_text(''.join(json.dumps({'prompt': f'Say {w}', 'answer': w}) + '\n' for w in words))
    return str(path)


def grpo_run(tmp_path, name, *args, ranks=1):
    launch = ['-m', 'torch.distributed.run', f'--nproc_per_node={ranks}'] if ranks > 1 else []
    data = prompt_file(tmp_path)
    cmd = [sys.executable, *launch, 'train.py', 'tests/rewards.py', *TINY, f'--out_dir={tmp_path / name}',
           f'--grpo.data={data}', f'--grpo.heldout={data}', *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_train_py_runs_grpo_and_logs_what_it_sampled(tmp_path):
    r = grpo_run(tmp_path, 'out', '--max_steps=2', '--eval_interval=2')
    assert r.returncode == 0, r.stderr
    recs = log(tmp_path / 'out')
    reused = grpo_run(tmp_path, 'reused', '--max_steps=2', '--eval_interval=2', "--grpo={'group': 4, "
                      "'max_new_tokens': 12, 'rewards': ['vowels'], 'iterations': 2}")
    assert reused.returncode == 0, reused.stderr
    again = log(tmp_path / 'reused')  # step 2 trains on step 1's completions: rho moved from 1
    assert again[0]['loss'] == recs[0]['loss'] and again[1]['reward_vowels'] == again[0]['reward_vowels']
    assert again[1]['clip_fraction'] > 0 and again[1]['loss'] != recs[1]['loss']
    for rec in recs:
        # at rho = 1 the loss is -mean(A) (about 0, the advantages centred per group); its
        # gradient is not 0
        assert abs(rec['loss']) < 1e-5 and rec['grad_norm'] > 0 and rec['w_grpo'] == 1.0
        assert 0 < rec['reward_vowels'] < 1 and rec['reward_std'] > 0 and 1 <= rec['completion_len'] <= 12
        assert rec['clip_fraction'] == 0 and rec['kl'] == 0 and rec['entropy'] > 0
    assert 0 <= recs[-1]['heldout_vowels'] <= 1 and 'val_loss' in recs[-1]


@pytest.mark.parametrize('args, message', [
    (["--grpo={'rewards': ['length']}"], "unknown reward 'length'"),
    (["--grpo={'rewards': ['correct_answer'], 'max_new_tokens': 12}"], "lacks the column"),
    (["--grpo={'rewards': ['vowels'], 'max_new_tokens': 60}"], "prompt 0 of"),
])
def test_bad_grpo_settings_end_in_one_line(tmp_path, args, message):
    path = tmp_path / 'noanswer.jsonl'
    path.write_text('{"prompt": "Say sun"}\n')
    r = grpo_run(tmp_path, 'out', '--max_steps=1', *args, f'--grpo.data={path}', '--grpo.heldout=')
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_two_ranks_give_the_loss_of_one_on_the_same_global_batch(tmp_path):
    """Rows are seeded by (seed, step, row), so 2 ranks x 1 micro-step sample what 1 rank x 2
    micro-steps samples; rewards are gathered, so the advantages are the same too."""
    args = ['--max_steps=3', '--eval_interval=3', '--gradient_accumulation_steps=2', "--objectives={'grpo': {'loss_type': 'dapo'}}"]
    r = grpo_run(tmp_path, 'one', *args)
    assert r.returncode == 0, r.stderr
    r = grpo_run(tmp_path, 'two', *args, ranks=2)
    assert r.returncode == 0, r.stderr
    one, two = log(tmp_path / 'one'), log(tmp_path / 'two')
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a['loss'] - b['loss']) < 1e-5 and a['reward_vowels'] == b['reward_vowels'], (a, b)
        assert a['completion_len'] == b['completion_len']
    # the same weights after the last step: the same greedy completions of the held-out prompts
    assert one[-1]['heldout_vowels'] == two[-1]['heldout_vowels']


def test_auto_batch_under_a_memory_limit_splits_a_grpo_step_and_keeps_its_losses(tmp_path):
    """auto_batch tries the largest completions GRPO can sample (its probe batch): under a limit
    it takes fewer prompts per micro-step in more micro-steps, and samples and trains exactly as
    the run set to that split by hand."""
    from test_train import auto_batch_runs

    data = prompt_file(tmp_path)
    args = ['tests/rewards.py', *TINY, f'--grpo.data={data}', '--grpo.heldout=', '--batch_size=8',
            '--gradient_accumulation_steps=1', '--max_steps=2', '--eval_interval=2',
            "--grpo={'group': 4, 'max_new_tokens': 12, 'rewards': ['vowels']}"]
    chosen, auto, plain = auto_batch_runs(args, tmp_path)
    assert len(auto) == len(plain) == 2
    for a, b in zip(auto, plain):
        assert a['loss'] == b['loss'] and a['reward_vowels'] == b['reward_vowels'], (a, b)
        assert a['completion_len'] == b['completion_len'] and a['grad_norm'] == b['grad_norm']
