"""
Training objectives and the curriculum that weighs them (the teachers are in teachers.py).

A ternary model trained from its fp self by cross-entropy alone loses quality; BitDistill
(Wu et al. 2025) recovers it by distilling from the fp model along a curriculum:
continued pretraining, then CE + logits distillation + attention-relation distillation.
Each loss here is a small `Objective`; the `ObjectiveManager` runs the student (and the
teacher) once, hands each active objective what it asked for, and sums the weighted
losses. The `CurriculumScheduler` says how much each objective weighs at each point of
training; an objective at weight 0 costs nothing, not even a forward pass.

The losses:
- `ce`         next-token cross-entropy on counted tokens (continued pretraining, SFT)
- `kd`         logits distillation, forward KL at temperature T, times T^2
               (Hinton et al. 2015); dense, or sparse from a remote teacher's
               top-k logprobs
- `attn`       attention-relation distillation (MiniLMv2, Wang et al. 2021) at one layer
- `hidden`     hidden-state distillation: MSE of L2-normalised states, depths mapped
- `diffusion`  masked-diffusion LM (MDLM, Sahoo et al. 2024; LLaDA, Nie et al. 2025)
- `lrc`        low-rank correction: the student's block outputs
               regress onto the teacher's
- `block`      block-wise reconstruction (EfficientQAT's Block-AP, Chen et al. 2024):
               each block, fed the fp block's input, learns to give its output
- `dpo`        direct preference optimisation (Rafailov et al. 2023),
               the teacher as reference
- `grpo`       group relative policy optimisation (Shao et al. 2024, DeepSeekMath §4) on
               sampled completions scored by reward functions (rl.py makes the batches)
- `onpolicy`   on-policy distillation (GKD, Agarwal et al. 2024): the teacher's
               distributions on the student's own completions, reverse KL or a
               generalized Jensen-Shannon divergence (rl.py samples them as for GRPO)
- `router`     a mixture of experts' auxiliary losses on its router logits: load
               balance, z-loss, the MSE of the mean squared probabilities (moe.py);
               on by default for an MoE student

This file needs only torch and a model called like model.py's Transformer:
model(idx, causal=..., feats=..., keep=...) returns the logits (at the `keep` positions)
and fills `feats`. A teacher (teachers.py) answers teacher(x, y, hidden, qkv_layer, keep)
with a dict: a local one (`local = True`) its logits and features, a remote one its top-k
logprobs.
"""
import math

import torch
import torch.nn.functional as F

IGNORE = -100  # a target that does not count (padding, SFT prompts)


class Objective:
    """A loss. `features` says what it needs from the shared forward pass of the student
    (and of the teacher, when `needs_teacher`); `reads_logits`, whether it reads their
    logits, which the shared pass then makes at the counted targets only. An objective
    with `own_forward` instead runs the model itself, on inputs it makes (masked
    diffusion, preference pairs) or on the model's own completions, when it
    `reads_rollouts` (batch['rollouts'], rl.py's)."""
    needs_teacher = False
    own_forward = False
    reads_logits = False
    reads_rollouts = False
    features = {}  # e.g. {'hidden': True, 'qkv_layer': 2}

    def loss(self, batch, s, t):
        """s, t: {'logits', 'hidden', 'qkv'} of student and teacher, the logits (N,
        vocab) at the N counted targets, batch['y'] (N,) those targets. Returns a
        scalar."""
        raise NotImplementedError


class LeanCrossEntropy(torch.autograd.Function):
    """F.cross_entropy summed over the counted targets, keeping only the logits z for
    backward. F.cross_entropy keeps their log-softmax too, and its backward makes two
    more (tokens, vocab) tensors; here backward makes one, softmax(z) - onehot(y): two
    fewer at the peak, 384 MiB at SmolLM2's vocab and 1024 tokens."""

    @staticmethod
    def forward(ctx, z, y):
        ctx.save_for_backward(z, y)
        return F.cross_entropy(z, y, ignore_index=IGNORE, reduction='sum')

    @staticmethod
    def backward(ctx, g):
        z, y = ctx.saved_tensors
        keep = (y != IGNORE).unsqueeze(1)
        index = y.clamp(min=0).unsqueeze(1)
        grad = torch.softmax(z, -1).scatter_add_(1, index, -keep.to(z.dtype))
        return grad.mul_(g * keep), None


def ce_loss(logits, y, reduction='mean'):
    """Cross-entropy over the counted targets (IGNORE marks the rest): their mean or
    their sum. logits (..., vocab), y (...). With none counted (an SFT window holding
    only a prompt) the mean is 0, with a zero gradient, instead of 0/0."""
    loss = LeanCrossEntropy.apply(logits.float().flatten(0, -2), y.flatten())
    return loss if reduction == 'sum' else loss / (y != IGNORE).sum().clamp(min=1)


class CrossEntropy(Objective):
    reads_logits = True

    def loss(self, batch, s, t):
        return ce_loss(s['logits'], batch['y'])


def kl_per_token(log_p, log_q):
    """KL(p || q) at every position, from log-probabilities over the last dimension."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kd_per_token(z_s, z_t, T):
    """T^2 * KL(p_t || p_s) for every position, p = softmax(z / T): (B, T_len)."""
    log_ps = F.log_softmax(z_s.float() / T, -1)
    log_pt = F.log_softmax(z_t.float() / T, -1)
    return T * T * kl_per_token(log_pt, log_ps)


class LogitsKD(Objective):
    """Forward KL from the teacher's distribution. A remote teacher sends only its top-k
    logprobs: renormalise those over the k tokens (after dividing by T) and compare with
    the student's log-softmax over the full vocabulary, taken at the same k token ids."""
    needs_teacher = reads_logits = True

    def __init__(self, temperature=5.0):
        self.T = temperature

    def loss(self, batch, s, t):
        counted = batch['y'] != IGNORE
        if 'logits' in t:
            per_token = kd_per_token(s['logits'], t['logits'], self.T)
        else:
            log_pt = F.log_softmax(t['topk_logprobs'].float() / self.T, -1)  # (N, k)
            log_ps_all = F.log_softmax(s['logits'].float() / self.T, -1)
            log_ps = log_ps_all.gather(-1, t['topk_ids'])
            # 0 where fewer than k logprobs came (-inf padding): 0 * log 0 counts as 0
            p = log_pt.exp()
            kl = (p * (log_pt - log_ps).masked_fill(p == 0, 0)).sum(-1)
            per_token = self.T ** 2 * kl
        return (per_token * counted).sum() / counted.sum().clamp(min=1)


def relations(a, heads, normalize):
    """(B, T, W) projections -> (B, r, T, T) log relation matrices
    over r relation heads."""
    B, T, W = a.shape
    if W % heads:
        raise ValueError(f"attn_heads={heads} must divide the width {W} of Q, K and V")
    a = a.float().view(B, T, heads, W // heads).transpose(1, 2)  # (B, r, T, d_r)
    if normalize:  # the official BitDistill trainer: cosine similarities at tau = 1
        a = F.normalize(a, dim=-1)
        return (a @ a.transpose(-1, -2)).log_softmax(-1)
    # MiniLMv2 / the paper
    scores = a @ a.transpose(-1, -2) / math.sqrt(W // heads)
    return scores.log_softmax(-1)


class AttentionRelationKD(Objective):
    """sum over Q, K, V of KL(R_teacher || R_student), averaged over the B*r*T rows. The
    relations are T x T, so teacher and student widths may differ (GQA included)."""
    needs_teacher = True

    def __init__(self, layer=-1, heads=4, normalize=False):
        self.layer, self.heads, self.normalize = layer, heads, normalize

    def bind(self, n_layer, n_layer_teacher):
        # layer -1 is the last one;
        # with a teacher of another depth, the same relative depth
        s = self.layer % n_layer
        t = depth_map(n_layer, n_layer_teacher)[s]
        self.features = {'qkv_layer': s, 'teacher_qkv_layer': t}

    def loss(self, batch, s, t):
        total = 0.0
        for a_s, a_t in zip(s['qkv'], t['qkv']):
            r_s = relations(a_s, self.heads, self.normalize)
            r_t = relations(a_t, self.heads, self.normalize)
            total = total + (r_t.exp() * (r_t - r_s)).sum(-1).mean()
        return total


def depth_map(n_student, n_teacher):
    """Student block i learns from the teacher block at the same relative depth
    (rounded up)."""
    return [((i + 1) * n_teacher + n_student - 1) // n_student - 1
            for i in range(n_student)]


class HiddenStateKD(Objective):
    needs_teacher = True
    features = {'hidden': True}

    def loss(self, batch, s, t):
        depths = depth_map(len(s['hidden']), len(t['hidden']))
        pairs = zip(s['hidden'], (t['hidden'][j] for j in depths))
        total = 0
        for h_s, h_t in pairs:
            n_s = F.normalize(h_s.float(), dim=-1)
            n_t = F.normalize(h_t.float(), dim=-1)
            total = total + F.mse_loss(n_s, n_t)
        return total / len(s['hidden'])


class LRCReconstruction(Objective):
    """Train the low-rank corrections (bitlinear.add_lrc) so that each student block's
    output matches the fp teacher's block output (MSE).
    Teacher and student share their depth."""
    needs_teacher = True
    features = {'hidden': True}

    def loss(self, batch, s, t):
        if len(s['hidden']) != len(t['hidden']):
            raise ValueError("lrc needs a teacher with the student's depth "
                             "(the student's own fp weights)")
        pairs = zip(s['hidden'], t['hidden'])
        total = sum(F.mse_loss(h_s.float(), h_t.float()) for h_s, h_t in pairs)
        return total / len(s['hidden'])


class BlockReconstruction(Objective):
    """Block-wise reconstruction: every student block gets the fp teacher's input to that
    block (teacher forcing) and learns to give the teacher block's output, so each block
    learns apart from the others, all at once, with a target for every token and channel
    instead of one label per token (EfficientQAT's Block-AP, Chen et al. 2024). A block's
    loss is its MSE relative to the mean square of what the teacher block adds to its
    input, so that every block counts alike whatever its scale; the loss averages the
    blocks. The teacher must be local, with the student's depth and width (its own fp
    weights)."""
    needs_teacher = own_forward = True

    def bind(self, n_layer, n_layer_teacher):
        if n_layer != n_layer_teacher:
            raise ValueError(f"block needs a teacher of the student's depth ({n_layer} "
                             f"blocks, not {n_layer_teacher}): its own fp weights")

    def run(self, model, teacher, batch):
        x = batch['x']
        none = torch.zeros_like(x, dtype=torch.bool)  # no logits: no loss reads them
        t = teacher(x, batch['y'], inputs=True, keep=none)
        feats = {'inputs': t['inputs'], 'hidden': []}
        model(x, feats=feats, keep=none)
        total = 0
        for s_out, t_in, t_out in zip(feats['hidden'], t['inputs'], t['hidden']):
            change = (t_out.float() - t_in.float()).pow(2).mean()
            total = total + F.mse_loss(s_out.float(), t_out.float()) / change
        return total / len(feats['hidden'])


def mask_token(enc, vocab_size):
    """Masked diffusion's mask id: the tokenizer's <|mask|> token, or else the first
    embedding row past the tokenizer's vocabulary (a spare row of the padding)."""
    if '<|mask|>' in enc.special_tokens_set:
        return enc.encode_single_token('<|mask|>')
    if enc.n_vocab >= vocab_size:
        raise ValueError("diffusion needs a mask token; the tokenizer has no <|mask|> "
                         "and the embedding no spare row")
    return enc.n_vocab


class MaskedDiffusion(Objective):
    """Masked-diffusion LM. Per sequence draw t ~ U(0, 1) and mask each counted token
    with probability p = (1 - eps) t + eps, using a dedicated mask id. The model sees
    the masked sequence with bidirectional attention and must recover the masked tokens;
    the loss is sum over masked tokens of CE / p, divided by the number of counted
    tokens, an unbiased bound on the likelihood (a fixed 15% mask without 1/p would be
    BERT). A causal checkpoint predicts token i at position i - 1, so we keep that shift
    (DiffuLLaMA, Dream). Tokens that do not count (SFT prompts) are never masked: they
    are the condition."""
    own_forward = True

    def __init__(self, mask_id, eps=1e-3):
        self.mask_id, self.eps = mask_id, eps

    def run(self, model, teacher, batch):
        x, y = batch['x'], batch['y']
        B, T = x.shape
        # token x[i] (i >= 1) counts when it is target y[i - 1]; x[0] is never predicted
        counted = torch.zeros_like(x, dtype=torch.bool)
        counted[:, 1:] = y[:, :-1] != IGNORE
        p = (1 - self.eps) * torch.rand(B, 1, device=x.device) + self.eps      # (B, 1)
        masked = counted & (torch.rand(B, T, device=x.device) < p)
        logits = model(torch.where(masked, self.mask_id, x), causal=False)
        z = logits[:, :-1].float().flatten(0, 1)
        ce = F.cross_entropy(z, x[:, 1:].flatten(), reduction='none').view(B, T - 1)
        return (ce * masked[:, 1:] / p).sum() / counted.sum().clamp(min=1)


def token_logprobs(logits, tokens):
    """log p(token) at each position: (B, L) from logits (B, L, V)."""
    logp = F.log_softmax(logits.float(), -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_logprob(logits, y):
    """Sum of log p(y_i) over the counted tokens of each sequence: (B,)."""
    return (token_logprobs(logits, y.clamp(min=0)) * (y != IGNORE)).sum(-1)


def dpo_loss(pi_w, pi_l, ref_w, ref_l, beta):
    return -F.logsigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l))).mean()


class DPO(Objective):
    """batch['pairs'] = (x_w, y_w, x_l, y_l): chosen and rejected answers, prompts
    IGNOREd in y. The frozen teacher is the reference policy."""
    needs_teacher = own_forward = True

    def __init__(self, beta=0.1):
        self.beta = beta

    def run(self, model, teacher, batch):
        x_w, y_w, x_l, y_l = batch['pairs']
        n = len(x_w)
        x, y = torch.cat((x_w, x_l)), torch.cat((y_w, y_l))  # one forward for both
        pi = sequence_logprob(model(x), y)
        ref = sequence_logprob(teacher(x, y)['logits'], y)
        return dpo_loss(pi[:n], pi[n:], ref[:n], ref[n:], self.beta)


def group_advantages(rewards, group, scale='group'):
    """GRPO's advantages: each reward minus the mean of its group (the G completions of one
    prompt, adjacent), divided by the group's standard deviation + 1e-4 ('group'), by the
    whole batch's ('batch'; Liu et al. 2025, Dr. GRPO, drop the group's as biased), or not
    at all ('none'). Standard deviations are torch's (n - 1). A group of equal rewards
    teaches nothing: its advantages are exactly 0, as are those of groups of one (on-policy
    distillation's single completions)."""
    if scale not in ('group', 'batch', 'none'):
        raise ValueError(f"scale_rewards={scale!r}; use 'group', 'batch' or 'none'")
    if group == 1:
        return torch.zeros_like(rewards)
    by_group = rewards.view(-1, group)  # (prompts, G)
    centred = (by_group - by_group.mean(1, keepdim=True)).flatten()
    if scale == 'group':
        return centred / (by_group.std(1).repeat_interleave(group) + 1e-4)
    if scale == 'batch':
        return centred / (rewards.std() + 1e-4)
    return centred


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, eps_low=0.2, eps_high=0.2,
              beta=0.0, aggregation='grpo', max_len=None, active_tokens=None):
    """The clipped surrogate of PPO with group advantages, plus beta times the k3 estimate
    of KL(policy || reference) (Schulman 2020) per token, aggregated as TRL names it:
    'grpo' the mean over each completion's tokens, then over completions (Shao et al.
    2024); 'bnpo' the mean over the batch's tokens; 'dr_grpo' the sum over tokens / (B x
    max_len) (Liu et al. 2025); 'dapo' the sum over tokens / `active_tokens`, the mean
    count of a micro-batch in the whole accumulated batch (Yu et al. 2025). logp, old_logp,
    ref_logp, mask: (B, L); advantages: (B,). Returns (loss, per-token parts)."""
    mask = mask.to(logp.dtype)
    # log-ratios are 0 at padding, so that nothing said after a stop token can overflow
    rho = torch.exp((logp - old_logp) * mask)  # exactly 1 on a batch's first use
    A = advantages.unsqueeze(1)
    clipped = torch.clamp(rho, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(rho * A, clipped * A)
    kl = torch.zeros_like(logp)
    if beta:
        to_ref = (ref_logp - logp) * mask
        kl = torch.exp(to_ref) - to_ref - 1
        per_token = per_token + beta * kl
    summed = (per_token * mask).sum()
    if aggregation == 'grpo':
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq.mean()
    elif aggregation == 'bnpo':
        loss = summed / mask.sum().clamp(min=1)
    elif aggregation == 'dr_grpo':
        loss = summed / (logp.size(0) * max_len)
    elif aggregation == 'dapo':
        loss = summed / active_tokens
    else:
        raise ValueError(f"loss_type={aggregation!r}; use grpo, bnpo, dr_grpo or dapo")
    # the clip is active where it took the minimum: rho below 1 - eps_low with A < 0,
    # above 1 + eps_high with A > 0
    low = (rho < 1 - eps_low) & (A < 0)
    high = (rho > 1 + eps_high) & (A > 0)
    return loss, {'kl': kl, 'clipped': (low | high).to(mask.dtype)}


class GRPO(Objective):
    """GRPO on batch['rollouts'] (rl.py): x (B, P + L) left-padded prompts and their
    sampled completions, valid (B, P + L) the real tokens, mask (B, L) the completion
    tokens that count (up to and including the stop token), advantages (B,), max_len,
    active_tokens and the temperature they were sampled at. The policy's log-probabilities
    are those of that sampling distribution, softmax(logits / temperature). A batch's first
    use is by the model that sampled it, so its log-probabilities then are those at sampling
    time: they are kept in the batch as `old_logp` (rho = 1), for its later uses (rl.py's
    `iterations`). The frozen teacher is the reference (beta > 0 only)."""
    own_forward = reads_rollouts = True

    def __init__(self, beta=0.0, eps_low=0.2, eps_high=0.2, loss_type='grpo'):
        self.beta, self.eps_low, self.eps_high = beta, eps_low, eps_high
        self.loss_type = loss_type
        self.needs_teacher = beta > 0
        self.metrics = {}

    def run(self, model, teacher, batch):
        r = batch['rollouts']
        x, valid, mask = r['x'], r['valid'], r['mask']
        P = x.size(1) - mask.size(1)  # completion token j is predicted at P - 1 + j
        completion, temperature = x[:, P:], r['temperature']
        logits = model(x, valid=valid)[:, P - 1:-1].float() / temperature
        log_probs = F.log_softmax(logits, -1)  # (B, L, V), once for the loss and entropy
        logp = log_probs.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        old_logp = r.setdefault('old_logp', logp.detach())
        ref = None
        if self.beta:
            ref_logits = teacher(x, None, valid=valid)['logits'][:, P - 1:-1]
            ref = token_logprobs(ref_logits.float() / temperature, completion)
        loss, parts = grpo_loss(logp, old_logp, ref, r['advantages'], mask,
                                self.eps_low, self.eps_high, self.beta, self.loss_type,
                                r['max_len'], r['active_tokens'])
        with torch.no_grad():
            counted = mask.sum().clamp(min=1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            measured = {'kl': parts['kl'], 'clip_fraction': parts['clipped'],
                        'entropy': entropy}
            self.metrics = {k: (v * mask).sum() / counted for k, v in measured.items()}
        return loss


def generalized_jsd(z_s, z_t, beta):
    """GKD's divergence of the student's next-token distribution p_s from the teacher's
    p_t at every position (Agarwal et al. 2024, §3, eq. 1): beta KL(p_t || m) + (1 - beta)
    KL(p_s || m) with m = beta p_t + (1 - beta) p_s; at the ends, where that vanishes, the
    KLs it tends to (up to 1 / beta) are taken instead: beta = 0 the forward KL(p_t || p_s),
    beta = 1 the reverse KL(p_s || p_t), which seeks the teacher's modes."""
    log_ps = F.log_softmax(z_s.float(), -1)
    log_pt = F.log_softmax(z_t.float(), -1)
    if beta == 0:
        return kl_per_token(log_pt, log_ps)
    if beta == 1:
        return kl_per_token(log_ps, log_pt)
    mixture = torch.stack((log_pt + math.log(beta), log_ps + math.log(1 - beta)))
    log_m = torch.logsumexp(mixture, 0)
    return beta * kl_per_token(log_pt, log_m) + (1 - beta) * kl_per_token(log_ps, log_m)


class OnPolicyKD(Objective):
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes"): logits KD on the student's own
    completions of training prompts instead of the dataset's answers, so that it learns
    what the teacher would say after the mistakes it actually makes. batch['rollouts']
    as GRPO reads it (rl.py samples them, the student as it is now); at each completion
    token that counts, generalized_jsd(student, teacher, beta), averaged over those
    tokens. The sampling is not differentiated through (the paper's §3.1)."""
    own_forward = needs_teacher = reads_rollouts = True

    def __init__(self, beta=1.0):
        if not 0 <= beta <= 1:
            raise ValueError(f"onpolicy beta={beta}; use a number from 0 (forward KL) "
                             f"to 1 (reverse KL)")
        self.beta = beta

    def run(self, model, teacher, batch):
        r = batch['rollouts']
        x, valid, mask = r['x'], r['valid'], r['mask']
        P = x.size(1) - mask.size(1)  # completion token j is predicted at P - 1 + j
        keep = torch.zeros_like(valid)
        keep[:, P - 1:-1] = mask
        z_s = model(x, valid=valid, keep=keep)  # (N, vocab)
        with torch.no_grad():
            z_t = teacher(x, None, valid=valid, keep=keep)['logits']
        per_token = generalized_jsd(z_s, z_t, self.beta)
        return per_token.sum() / mask.sum().clamp(min=1)


def router_losses(logits, top_k):
    """One MoE layer's router terms from its logits (N, n_experts):
    - load_balance  n_experts * sum_i f_i * P_i (Switch Transformer, Fedus et al. 2021,
                    eq. 4), f_i the fraction of the N * top_k assignments that go to
                    expert i, P_i the mean probability of expert i; 1 when balanced.
                    (transformers' load_balancing_loss_func counts f_i per token, so
                    that its value is top_k times this.)
    - router_aux    MSE(mean over tokens of p^2, 1 / n_experts) over the experts: 0 when
                    every token is sure of one expert and each expert gets as many
    - z_loss        mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022):
                    keeps the logits small, so their softmax stable in low precision
    - router_entropy  mean entropy of p, logged only
    - expert_load   the busiest expert's assignments over the mean, logged only"""
    E = logits.size(-1)
    z = logits.float()
    p = z.softmax(dim=-1)  # (N, E)
    chosen = p.topk(top_k, dim=-1).indices  # (N, k)
    counts = chosen.flatten().bincount(minlength=E).float()  # (E,)
    f = counts / chosen.numel()
    P = p.mean(dim=0)
    log_p = z.log_softmax(dim=-1)
    return {'load_balance': E * (f * P).sum(),
            'router_aux': (p.square().mean(dim=0) - 1 / E).square().mean(),
            'z_loss': torch.logsumexp(z, dim=-1).square().mean(),
            'router_entropy': -(p * log_p).sum(dim=-1).mean().detach(),
            'expert_load': counts.max() / counts.mean()}


class RouterLoss(Objective):
    """The router losses of every MoE layer of the shared forward pass, summed with
    their coefficients and averaged over the layers. Objectives that run the model
    themselves (diffusion, DPO, GRPO) do not add them. Logs each term (the mean over
    layers), the entropy, and each layer's expert load (max / mean assignments)."""
    features = {'router': True}

    def __init__(self, top_k=2, load_balance=0.01, z_loss=0.001, aux=0.0):
        self.top_k = top_k
        self.coef = {'load_balance': load_balance, 'z_loss': z_loss, 'router_aux': aux}
        self.metrics = {}

    def loss(self, batch, s, t):
        layers = [router_losses(z, self.top_k) for z in s['router']]
        mean = {k: sum(terms[k] for terms in layers) / len(layers) for k in layers[0]}
        self.metrics = {k: v.detach() for k, v in mean.items()}
        loads = [terms['expert_load'] for terms in layers]
        self.metrics['expert_load'] = max(loads)
        self.metrics |= {f'expert_load_{i}': load for i, load in enumerate(loads)}
        return sum(c * mean[k] for k, c in self.coef.items())


OBJECTIVES = {'ce': CrossEntropy, 'kd': LogitsKD, 'attn': AttentionRelationKD,
              'hidden': HiddenStateKD, 'lrc': LRCReconstruction, 'block': BlockReconstruction,
              'diffusion': MaskedDiffusion, 'dpo': DPO, 'grpo': GRPO,
              'onpolicy': OnPolicyKD, 'router': RouterLoss}


class CurriculumScheduler:
    """Phases [(end, {name: weight}), ...] with `end` a fraction of training, increasing
    to 1. 'switch' holds each phase's weights until its end; 'linear' and 'cosine' move
    from a phase's weights at its start to the next phase's weights at its end, so the
    weights are continuous. A name missing from a phase weighs 0 there."""

    def __init__(self, phases, blend='switch'):
        if blend not in ('switch', 'linear', 'cosine'):
            raise ValueError(f"blend={blend!r}; use 'switch', 'linear' or 'cosine'")
        ends = [end for end, _ in phases]
        if not phases or ends != sorted(ends) or ends[-1] < 1:
            raise ValueError(f"curriculum phase ends {ends} must increase "
                             f"and the last must be 1.0")
        self.phases, self.blend = phases, blend
        self.names = sorted({name for _, w in phases for name in w})

    def weights(self, progress):
        last = len(self.phases) - 1
        k = next((i for i, (end, _) in enumerate(self.phases) if progress < end), last)
        here = self.phases[k][1]
        if self.blend == 'switch' or k == last:
            return {n: float(here.get(n, 0.0)) for n in self.names}
        start, end = self.phases[k - 1][0] if k else 0.0, self.phases[k][0]
        a = (progress - start) / (end - start)
        if self.blend == 'cosine':
            a = 0.5 - 0.5 * math.cos(math.pi * a)
        after = self.phases[k + 1][1]
        return {n: (1 - a) * here.get(n, 0.0) + a * after.get(n, 0.0)
                for n in self.names}


def run_model(model, x, hidden=False, qkv_layer=None, valid=None, router=False,
              keep=None):
    """One forward pass: {'logits'} (at the `keep` positions, when given), plus every
    block's output ('hidden'), the q, k, v of one block ('qkv') and every MoE layer's
    router logits ('router') when asked for. `valid` marks the real tokens of
    left-padded rows (GRPO's rollouts)."""
    feats = {'hidden': []} if hidden else {}
    if qkv_layer is not None:
        feats.update(qkv=[], qkv_layer=qkv_layer)
    if router:
        feats['router'] = []
    kw = {} if valid is None else {'valid': valid.to(next(model.parameters()).device)}
    if keep is not None:
        kw['keep'] = keep
    logits = model(x, feats=feats, **kw)
    asked = ('hidden', 'qkv', 'router')
    return {'logits': logits, **{k: feats[k] for k in asked if k in feats}}


class ObjectiveManager:
    """Runs one training micro-step's objectives: one shared student forward with the
    union of the features the active objectives want, one teacher forward if any of them
    needs it, each own-forward objective, and the weighted sum. The shared forwards make
    the logits at the counted targets only, and none when no objective reads them."""

    def __init__(self, objectives, curriculum, teacher=None, n_layer=None):
        self.objectives, self.curriculum, self.teacher = objectives, curriculum, teacher
        local = getattr(teacher, 'local', False)  # teachers.py
        remote = teacher is not None and not local
        for name, obj in objectives.items():
            if obj.needs_teacher and teacher is None:
                raise ValueError(f"objective {name!r} needs a teacher; "
                                 f"set teacher= in the config")
            if remote and (obj.features or obj.own_forward) and obj.needs_teacher:
                raise ValueError(f"objective {name!r} needs a local teacher; "
                                 f"a remote one sends logprobs only")
            if hasattr(obj, 'bind'):
                obj.bind(n_layer, teacher.n_layer if local else n_layer)
        missing = set(curriculum.names) - set(objectives)
        if missing:
            raise ValueError(f"the curriculum weighs {sorted(missing)} "
                             f"but objectives only has {sorted(objectives)}")


    @classmethod
    def from_settings(cls, settings, phases, blend, teacher, student, mask_id=None):
        """A run's manager: settings {name: kwargs}, the curriculum's phases and blend;
        masked diffusion gets `mask_id` unless its settings name one. Raises ValueError
        for an unknown objective, settings that do not fit, or a local teacher whose
        vocabulary is not the student's."""
        if getattr(teacher, 'local', False):
            vocab, own = teacher.model.config.vocab_size, student.config.vocab_size
            if vocab != own:
                raise ValueError(f"teacher vocab {vocab} != student vocab {own}; both "
                                 f"must share a tokenizer")
        unknown = set(settings) - set(OBJECTIVES)
        if unknown:
            raise ValueError(f"unknown objective {sorted(unknown)}; "
                             f"choose from {sorted(OBJECTIVES)}")
        kwargs = {name: dict(kw) for name, kw in settings.items()}  # the run's stay as set
        if 'diffusion' in kwargs:
            kwargs['diffusion'].setdefault('mask_id', mask_id)
        experts, top_k = student.config.n_experts, student.config.top_k
        if experts and 'router' not in kwargs:  # an MoE's router losses, at weight 1
            kwargs['router'] = {}
            phases = [(end, {'router': 1.0} | w) for end, w in phases]
        if 'router' in kwargs and not experts:
            raise ValueError("objective 'router' needs a mixture of experts: n_experts > 0")
        if 'router' in kwargs:
            kwargs['router'].setdefault('top_k', top_k)
        losses = {n: OBJECTIVES[n](**kw) for n, kw in kwargs.items()}
        curriculum = CurriculumScheduler(phases, blend)
        return cls(losses, curriculum, teacher, student.config.n_layer)

    def active(self, progress):
        """The names of the objectives that weigh more than 0 at `progress`."""
        weights = self.curriculum.weights(progress)
        return {n for n in self.objectives if weights.get(n, 0.0) > 0}

    def readers(self):
        """The names of the objectives that read the model's own completions."""
        return sorted(n for n, o in self.objectives.items() if o.reads_rollouts)

    def samples(self, progress):
        """Whether an objective active at `progress` reads the model's own completions."""
        return any(self.objectives[n].reads_rollouts for n in self.active(progress))

    def new_phase(self, step, steps):
        """Whether step `step` of `steps` trains other objectives than the step before:
        known from the step alone, so a resumed run does at a switch what a straight
        run does."""
        return step > 0 and self.active(step / steps) != self.active((step - 1) / steps)

    def __call__(self, model, batch, progress):
        weights = self.curriculum.weights(progress)
        active = {n: self.objectives[n] for n in sorted(self.active(progress))}
        if not active:
            raise ValueError(f"no objective weighs more than 0 at {progress:.0%} "
                             f"of training; fix the curriculum")
        shared = [o for o in active.values() if not o.own_forward]
        want = {k: v for o in shared for k, v in o.features.items()}
        hidden, layer = want.get('hidden', False), want.get('qkv_layer')
        losses = {}
        if shared:
            keep = batch['y'] != IGNORE
            if not any(o.reads_logits for o in shared):
                keep = torch.zeros_like(keep)
            router = want.get('router', False)
            s = run_model(model, batch['x'], hidden, layer, router=router, keep=keep)
            t = None
            if any(o.needs_teacher for o in shared):
                t_layer = want.get('teacher_qkv_layer')
                t = self.teacher(batch['x'], batch['y'], hidden, t_layer, keep=keep)
            kept = dict(batch, y=batch['y'][keep])
            for n, o in active.items():
                if not o.own_forward:
                    losses[n] = o.loss(kept, s, t)
        for n, o in active.items():
            if o.own_forward:
                losses[n] = o.run(model, self.teacher, batch)
        total = sum(weights[n] * losses[n] for n in losses)
        metrics = {f'loss_{n}': v.detach() for n, v in losses.items()}
        for n in active:  # what an objective measures besides its loss (GRPO's KL, ...)
            metrics.update(getattr(self.objectives[n], 'metrics', {}))
        metrics.update({f'w_{n}': w for n, w in weights.items()})
        return total, metrics
