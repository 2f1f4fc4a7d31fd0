"""On-policy distillation (objectives.OnPolicyKD): the divergences against sums written out
in plain Python, their gradients against the hand-derived ones (and central differences for the
generalized JSD), the objective against a fresh forward of student and teacher at the
completion tokens only, and train.py running it on the model's own samples."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import engine
from model import ModelConfig, Transformer
from objectives import OnPolicyKD, generalized_jsd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def softmax(z):
    top = max(z)
    e = [math.exp(v - top) for v in z]
    return [v / sum(e) for v in e]


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def jsd_by_hand(z_s, z_t, beta):
    """GKD's JSD(beta) of one position, in plain Python; at beta 0 and 1 the KLs it tends to."""
    p_s, p_t = softmax(z_s), softmax(z_t)
    if beta == 0:
        return kl(p_t, p_s)
    if beta == 1:
        return kl(p_s, p_t)
    m = [beta * a + (1 - beta) * b for a, b in zip(p_t, p_s)]
    return beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)


@pytest.mark.parametrize('beta', [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_is_the_sum_by_hand(beta):
    torch.manual_seed(0)
    z_s, z_t = torch.randn(5, 7) * 2, torch.randn(5, 7) * 2
    got = generalized_jsd(z_s, z_t, beta)
    want = [jsd_by_hand(a.tolist(), b.tolist(), beta) for a, b in zip(z_s, z_t)]
    assert got.shape == (5,)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert (got > 0).all()
    assert torch.allclose(generalized_jsd(z_t, z_t, beta), torch.zeros(5), atol=1e-6)


def test_jsd_tends_to_the_kls_at_its_ends():
    """JSD(beta) / beta -> forward KL as beta -> 0 and JSD(beta) / (1 - beta) -> reverse KL as
    beta -> 1 (GKD §3): the ends the objective takes are the limits of the family, not other
    losses."""
    torch.manual_seed(1)
    z_s, z_t = torch.randn(4, 6), torch.randn(4, 6)
    near_zero = generalized_jsd(z_s, z_t, 1e-3) / 1e-3
    near_one = generalized_jsd(z_s, z_t, 1 - 1e-3) / 1e-3
    assert torch.allclose(near_zero, generalized_jsd(z_s, z_t, 0.0), rtol=1e-2)
    assert torch.allclose(near_one, generalized_jsd(z_s, z_t, 1.0), rtol=1e-2)
    far = generalized_jsd(z_s, z_t, 0.5) / 0.5
    assert not torch.allclose(far, generalized_jsd(z_s, z_t, 0.0), rtol=1e-1)


def test_kl_gradients_are_the_hand_derived_ones():
    """d KL(p_t || p_s) / d z_s = p_s - p_t; d KL(p_s || p_t) / d z_s = p_s * (log p_s - log p_t
    - KL(p_s || p_t)); the teacher's logits get none."""
    torch.manual_seed(2)
    z_t = torch.randn(3, 8)
    for beta in (0.0, 1.0):
        z_s = torch.randn(3, 8, requires_grad=True)
        generalized_jsd(z_s, z_t, beta).sum().backward()
        p_s, p_t = torch.softmax(z_s.detach(), -1), torch.softmax(z_t, -1)
        if beta == 0:
            want = p_s - p_t
        else:
            log_ratio = p_s.log() - p_t.log()
            want = p_s * (log_ratio - (p_s * log_ratio).sum(-1, keepdim=True))
        assert torch.allclose(z_s.grad, want, atol=1e-6), beta


def test_jsd_gradient_is_the_central_difference():
    """The divergence computes in float32: steps of 1e-2, whose error is O(h^2)."""
    torch.manual_seed(3)
    z_s, z_t = torch.randn(2, 5), torch.randn(2, 5)
    z = z_s.clone().requires_grad_(True)
    generalized_jsd(z, z_t, 0.5).sum().backward()
    h = 1e-2
    for i in range(2):
        for j in range(5):
            up, down = z_s.clone(), z_s.clone()
            up[i, j] += h
            down[i, j] -= h
            diff = (generalized_jsd(up, z_t, 0.5).sum() - generalized_jsd(down, z_t, 0.5).sum()) / (2 * h)
            assert abs(z.grad[i, j].item() - diff.item()) < 1e-4


def test_beta_outside_0_to_1_is_refused():
    with pytest.raises(ValueError, match='onpolicy beta=1.5'):
        OnPolicyKD(beta=1.5)


def tiny_model(seed):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96,
                      max_seq_len=64)
    return Transformer(cfg).eval()


def test_objective_is_the_divergence_at_the_completion_tokens_only():
    """On left-padded prompts and completions that stop at different lengths: the mean over
    the completion tokens that count of the divergence of a fresh full forward's logits,
    student from teacher; padding and prompt tokens change nothing and the teacher learns
    nothing."""
    student, teacher_model = tiny_model(0), tiny_model(1)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    x, valid, mask, _ = engine.rollout(student, prompts, 6, temperature=1.0, stop_ids=[3, 4, 5],
                                       seeds=[1, 2, 3])
    assert mask.sum() < mask.numel()  # some row stopped early: its tail does not count
    batch = {'rollouts': dict(x=x, valid=valid, mask=mask, temperature=1.0)}

    def teacher(x, y, valid=None, keep=None):
        with torch.no_grad():
            return {'logits': teacher_model(x, valid=valid, keep=keep)}
    for beta in (1.0, 0.5):
        student.zero_grad()
        loss = OnPolicyKD(beta=beta).run(student, teacher, batch)
        loss.backward()
        P = x.size(1) - mask.size(1)
        z_s = student(x, valid=valid)[:, P - 1:-1].detach()
        z_t = teacher_model(x, valid=valid)[:, P - 1:-1].detach()
        terms = []
        for b in range(x.size(0)):
            for j in range(mask.size(1)):
                if mask[b, j]:
                    terms.append(jsd_by_hand(z_s[b, j].tolist(), z_t[b, j].tolist(), beta))
        assert abs(loss.item() - sum(terms) / len(terms)) < 1e-5
        assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
        assert all(p.grad is None for p in teacher_model.parameters())
    # what follows a stop token is not looked at: other tokens there, the same loss
    changed = x.clone()
    changed[:, P:][~mask] = 63
    again = OnPolicyKD(beta=0.5).run(student, teacher, {'rollouts': dict(batch['rollouts'], x=changed)})
    assert abs(again.item() - loss.item()) < 1e-6
    same = OnPolicyKD().run(student, lambda x, y, valid, keep: {'logits': student(x, valid=valid, keep=keep)},
                            batch)
    assert abs(same.item()) < 1e-6


ARITH = ['--arch.n_layer=2', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1',
         '--arch.intermediate_size=64', '--eval_iters=1', '--log_interval=1', '--sample.tokens=0',
         '--warmup_steps=1', '--tokenizer=bytes', '--block_size=256', '--batch_size=2']


@pytest.mark.slow
def test_train_py_distils_on_the_students_own_completions(tmp_path):
    """A teacher run, then a student that samples one completion of each of 2 arithmetic prompts a
    step and learns the teacher's distributions on them, beside the CE on the data; a curriculum
    that leaves onpolicy out of its first phase samples nothing there. Without grpo.data the
    objective is refused before any work."""
    teacher = tmp_path / 'teacher'
    r = subprocess.run([sys.executable, 'train.py', *ARITH, '--max_steps=1', '--eval_interval=1',
                        f'--out_dir={teacher}'], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    student = tmp_path / 'student'
    args = [*ARITH, '--max_steps=4', '--eval_interval=4', f'--out_dir={student}', f'--teacher={teacher}',
            "--objectives={'ce': {}, 'onpolicy': {'beta': 0.5}}",
            "--curriculum=[(0.5, {'ce': 1.0}), (1.0, {'ce': 1.0, 'onpolicy': 1.0})]",
            "--grpo={'data': 'arithmetic_train', 'heldout': '', 'group': 1, 'max_new_tokens': 8, "
            "'rewards': ['correct_answer', 'format']}"]
    r = subprocess.run([sys.executable, 'train.py', *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, NANOBITNET_CACHE=str(tmp_path / 'cache')))
    assert r.returncode == 0, r.stderr
    with open(student / 'log.jsonl') as f:
        recs = [json.loads(line) for line in f]
    assert [rec['step'] for rec in recs] == [1, 2, 3, 4]
    for rec in recs[:2]:
        assert 'loss_onpolicy' not in rec and 'completion_len' not in rec
    for rec in recs[2:]:
        assert rec['loss_onpolicy'] > 0 and 1 <= rec['completion_len'] <= 8
        assert 'reward_correct_answer' in rec and 'reward_std' not in rec
    refused = subprocess.run([sys.executable, 'train.py', *args[:-1], f'--out_dir={tmp_path / "no"}'],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0
    assert "objective 'onpolicy' trains on the model's completions" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_one_completion_a_prompt_has_no_advantage():
    from objectives import group_advantages
    for scale in ('group', 'batch', 'none'):
        assert torch.equal(group_advantages(torch.tensor([1.0, 0.0, 0.5]), 1, scale), torch.zeros(3))
