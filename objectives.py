"""
Training objectives, the curriculum that weighs them, the teachers they learn from, and the
optimisation that applies them (optimizers, LR schedules, gradient clipping, the LR range test).

A ternary model trained from its fp self by cross-entropy alone loses quality; BitDistill
(Wu et al. 2025) recovers it by distilling from the fp model along a curriculum:
continued pretraining, then CE + logits distillation + attention-relation distillation.
Each loss here is a small `Objective`; the `ObjectiveManager` runs the student (and the
teacher) once, hands each active objective what it asked for, and sums the weighted
losses. The `CurriculumScheduler` says how much each objective weighs at each point of
training; an objective at weight 0 costs nothing, not even a forward pass.

The losses:
- `ce`         next-token cross-entropy on counted tokens (continued pretraining, SFT)
- `kd`         logits distillation, forward KL at temperature T, times T^2 (Hinton et al. 2015);
               dense, or sparse from a remote teacher's top-k logprobs
- `attn`       attention-relation distillation (MiniLMv2, Wang et al. 2021) at one layer
- `hidden`     hidden-state distillation: MSE of L2-normalised states, depths mapped
- `diffusion`  masked-diffusion LM (MDLM, Sahoo et al. 2024; LLaDA, Nie et al. 2025)
- `lrc`        low-rank correction: the student's block outputs regress onto the teacher's
- `dpo`        direct preference optimisation (Rafailov et al. 2023), the teacher as reference

This file needs only torch (and requests for the remote teacher) and a model called like
model.py's Transformer: model(idx, causal=..., feats=...) returns the logits and fills `feats`.
Both teachers answer teacher(x, y, hidden, qkv_layer) with a dict: the local one its logits and
features, the remote one its top-k logprobs.
"""
import json
import math
import time

import requests
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

IGNORE = -100  # a target that does not count (padding, SFT prompts)


class Objective:
    """A loss. `features` says what it needs from the shared forward pass of the student
    (and of the teacher, when `needs_teacher`); an objective with `own_forward` instead
    runs the model itself, on inputs it makes (masked diffusion, preference pairs)."""
    needs_teacher = False
    own_forward = False
    features = {}  # e.g. {'hidden': True, 'qkv_layer': 2}

    def loss(self, batch, s, t):
        """s, t: {'logits', 'hidden', 'qkv'} of student and teacher. Returns a scalar."""
        raise NotImplementedError


class LeanCrossEntropy(torch.autograd.Function):
    """F.cross_entropy summed over the counted targets, keeping only the logits z for backward.
    F.cross_entropy keeps their log-softmax too, and its backward makes two more (tokens, vocab)
    tensors; here backward makes one, softmax(z) - onehot(y): two fewer at the peak, 384 MiB at
    SmolLM2's vocab and 1024 tokens."""

    @staticmethod
    def forward(ctx, z, y):
        ctx.save_for_backward(z, y)
        return F.cross_entropy(z, y, ignore_index=IGNORE, reduction='sum')

    @staticmethod
    def backward(ctx, g):
        z, y = ctx.saved_tensors
        keep = (y != IGNORE).unsqueeze(1)
        grad = torch.softmax(z, -1).scatter_add_(1, y.clamp(min=0).unsqueeze(1), -keep.to(z.dtype))
        return grad.mul_(g * keep), None


def ce_loss(logits, y, reduction='mean'):
    """Cross-entropy over the counted targets (IGNORE marks the rest): their mean or their sum. With none
    counted (an SFT window holding only a prompt) the mean is 0, with a zero gradient, instead of 0/0."""
    loss = LeanCrossEntropy.apply(logits.float().flatten(0, 1), y.flatten())
    return loss if reduction == 'sum' else loss / (y != IGNORE).sum().clamp(min=1)


class CrossEntropy(Objective):

    def loss(self, batch, s, t):
        return ce_loss(s['logits'], batch['y'])


def kd_per_token(z_s, z_t, T):
    """T^2 * KL(p_t || p_s) for every position, p = softmax(z / T): (B, T_len)."""
    log_ps, log_pt = F.log_softmax(z_s.float() / T, -1), F.log_softmax(z_t.float() / T, -1)
    return T * T * (log_pt.exp() * (log_pt - log_ps)).sum(-1)


class LogitsKD(Objective):
    """Forward KL from the teacher's distribution. A remote teacher sends only its top-k
    logprobs: renormalise those over the k tokens (after dividing by T) and compare with the
    student's log-softmax over the full vocabulary, taken at the same k token ids."""
    needs_teacher = True

    def __init__(self, temperature=5.0):
        self.T = temperature

    def loss(self, batch, s, t):
        counted = batch['y'] != IGNORE
        if 'logits' in t:
            per_token = kd_per_token(s['logits'], t['logits'], self.T)
        else:
            log_pt = F.log_softmax(t['topk_logprobs'].float() / self.T, -1)          # (B, T, k)
            log_ps = F.log_softmax(s['logits'].float() / self.T, -1).gather(-1, t['topk_ids'])
            p = log_pt.exp()  # 0 where fewer than k logprobs came (-inf padding): 0 * log 0 counts as 0
            per_token = self.T ** 2 * (p * (log_pt - log_ps).masked_fill(p == 0, 0)).sum(-1)
        return (per_token * counted).sum() / counted.sum().clamp(min=1)


def relations(a, heads, normalize):
    """(B, T, W) projections -> (B, r, T, T) log relation matrices over r relation heads."""
    B, T, W = a.shape
    if W % heads:
        raise ValueError(f"attn_heads={heads} must divide the width {W} of Q, K and V")
    a = a.float().view(B, T, heads, W // heads).transpose(1, 2)  # (B, r, T, d_r)
    if normalize:  # the official BitDistill trainer: cosine similarities at tau = 1
        a = F.normalize(a, dim=-1)
        return (a @ a.transpose(-1, -2)).log_softmax(-1)
    return (a @ a.transpose(-1, -2) / math.sqrt(W // heads)).log_softmax(-1)  # MiniLMv2 / the paper


class AttentionRelationKD(Objective):
    """sum over Q, K, V of KL(R_teacher || R_student), averaged over the B*r*T rows. The
    relations are T x T, so teacher and student widths may differ (GQA included)."""
    needs_teacher = True

    def __init__(self, layer=-1, heads=4, normalize=False):
        self.layer, self.heads, self.normalize = layer, heads, normalize

    def bind(self, n_layer, n_layer_teacher):
        # layer -1 is the last one; with a teacher of another depth, the same relative depth
        s = self.layer % n_layer
        self.features = {'qkv_layer': s, 'teacher_qkv_layer': depth_map(n_layer, n_layer_teacher)[s]}

    def loss(self, batch, s, t):
        total = 0.0
        for a_s, a_t in zip(s['qkv'], t['qkv']):
            r_s, r_t = relations(a_s, self.heads, self.normalize), relations(a_t, self.heads, self.normalize)
            total = total + (r_t.exp() * (r_t - r_s)).sum(-1).mean()
        return total


def depth_map(n_student, n_teacher):
    """Student block i learns from the teacher block at the same relative depth (rounded up)."""
    return [((i + 1) * n_teacher + n_student - 1) // n_student - 1 for i in range(n_student)]


class HiddenStateKD(Objective):
    needs_teacher = True
    features = {'hidden': True}

    def loss(self, batch, s, t):
        pairs = zip(s['hidden'], (t['hidden'][j] for j in depth_map(len(s['hidden']), len(t['hidden']))))
        return sum(F.mse_loss(F.normalize(h_s.float(), dim=-1), F.normalize(h_t.float(), dim=-1))
                   for h_s, h_t in pairs) / len(s['hidden'])


class LRCReconstruction(Objective):
    """Train the low-rank corrections (bitlinear.add_lrc) so that each student block's output
    matches the fp teacher's block output (MSE). Teacher and student share their depth."""
    needs_teacher = True
    features = {'hidden': True}

    def loss(self, batch, s, t):
        if len(s['hidden']) != len(t['hidden']):
            raise ValueError("lrc needs a teacher with the student's depth (the student's own fp weights)")
        return sum(F.mse_loss(h_s.float(), h_t.float()) for h_s, h_t in zip(s['hidden'], t['hidden'])) / len(s['hidden'])


class MaskedDiffusion(Objective):
    """Masked-diffusion LM. Per sequence draw t ~ U(0, 1) and mask each counted token with
    probability p = (1 - eps) t + eps, using a dedicated mask id. The model sees the masked
    sequence with bidirectional attention and must recover the masked tokens; the loss is
    sum over masked tokens of CE / p, divided by the number of counted tokens, an unbiased
    bound on the likelihood (a fixed 15% mask without 1/p would be BERT). A causal checkpoint
    predicts token i at position i - 1, so we keep that shift (DiffuLLaMA, Dream). Tokens that
    do not count (SFT prompts) are never masked: they are the condition."""
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
        ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction='none').view(B, T - 1)
        return (ce * masked[:, 1:] / p).sum() / counted.sum().clamp(min=1)


def sequence_logprob(logits, y):
    """Sum of log p(y_i) over the counted tokens of each sequence: (B,)."""
    logp = F.log_softmax(logits.float(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * (y != IGNORE)).sum(-1)


def dpo_loss(pi_w, pi_l, ref_w, ref_l, beta):
    return -F.logsigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l))).mean()


class DPO(Objective):
    """batch['pairs'] = (x_w, y_w, x_l, y_l): chosen and rejected answers, prompts IGNOREd in y.
    The frozen teacher is the reference policy."""
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


def preference_pairs(path, enc, block_size, eos):
    """A jsonl of {"prompt", "chosen", "rejected"} as DPO's pairs: four (N, block_size) tensors
    x_w, y_w, x_l, y_l. Each sequence starts with eos (as every document does) and the prompt, and
    the answer follows, ending with eos; the targets of the prompt and of the padding are IGNORE."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            ex = json.loads(line)
            prompt = [eos] + enc.encode_ordinary(ex['prompt'])
            if len(prompt) >= block_size:
                raise ValueError(f"{path} line {n}: a prompt of {len(prompt)} tokens leaves no room for an answer "
                                 f"in block_size={block_size}; shorten it or raise block_size")
            for answer in (ex['chosen'], ex['rejected']):
                ids = (prompt + enc.encode_ordinary(answer) + [eos])[:block_size + 1]
                x, y = torch.full((block_size,), eos), torch.full((block_size,), IGNORE)
                x[:len(ids) - 1] = torch.tensor(ids[:-1])
                y[len(prompt) - 1:len(ids) - 1] = torch.tensor(ids[len(prompt):])
                rows.append((x, y))
    x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    return x[0::2], y[0::2], x[1::2], y[1::2]


OBJECTIVES = {'ce': CrossEntropy, 'kd': LogitsKD, 'attn': AttentionRelationKD, 'hidden': HiddenStateKD,
              'lrc': LRCReconstruction, 'diffusion': MaskedDiffusion, 'dpo': DPO}


class CurriculumScheduler:
    """Phases [(end, {name: weight}), ...] with `end` a fraction of training, increasing to
    1. 'switch' holds each phase's weights until its end; 'linear' and 'cosine' move from
    a phase's weights at its start to the next phase's weights at its end, so the weights
    are continuous. A name missing from a phase weighs 0 there."""

    def __init__(self, phases, blend='switch'):
        if blend not in ('switch', 'linear', 'cosine'):
            raise ValueError(f"blend={blend!r}; use 'switch', 'linear' or 'cosine'")
        ends = [end for end, _ in phases]
        if not phases or ends != sorted(ends) or ends[-1] < 1:
            raise ValueError(f"curriculum phase ends {ends} must increase and the last must be 1.0")
        self.phases, self.blend = phases, blend
        self.names = sorted({name for _, w in phases for name in w})

    def weights(self, progress):
        k = next((i for i, (end, _) in enumerate(self.phases) if progress < end), len(self.phases) - 1)
        here = self.phases[k][1]
        if self.blend == 'switch' or k == len(self.phases) - 1:
            return {n: float(here.get(n, 0.0)) for n in self.names}
        start, end = self.phases[k - 1][0] if k else 0.0, self.phases[k][0]
        a = (progress - start) / (end - start)
        if self.blend == 'cosine':
            a = 0.5 - 0.5 * math.cos(math.pi * a)
        after = self.phases[k + 1][1]
        return {n: (1 - a) * here.get(n, 0.0) + a * after.get(n, 0.0) for n in self.names}


def run_model(model, x, hidden=False, qkv_layer=None):
    """One forward pass: {'logits'}, plus every block's output ('hidden') and the q, k, v of one
    block ('qkv') when asked for."""
    feats = {'hidden': []} if hidden else {}
    if qkv_layer is not None:
        feats.update(qkv=[], qkv_layer=qkv_layer)
    logits = model(x, feats=feats)
    return {'logits': logits, **{k: feats[k] for k in ('hidden', 'qkv') if k in feats}}


class LocalTeacher:
    """A frozen model on its own device and dtype: eval mode, no gradients."""

    def __init__(self, model, device='cpu', dtype=torch.float32):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device = device
        self.n_layer = len(model.layers)

    @torch.no_grad()
    def __call__(self, x, y, hidden=False, qkv_layer=None):
        out = run_model(self.model, x.to(self.device), hidden, qkv_layer)
        return {k: v.to(x.device) if torch.is_tensor(v) else [t.to(x.device) for t in v] for k, v in out.items()}


class BaseTeacher(LocalTeacher):
    """A LoRA student's frozen base as the teacher (DPO's reference): the student itself with its
    adapters switched off by `switch(model, on)` (bitlinear.set_adapters), so the model is held once."""

    def __init__(self, model, switch):
        self.model, self.switch, self.n_layer = model, switch, len(model.layers)
        self.device = next(model.parameters()).device

    def __call__(self, *args):
        self.switch(self.model, False)
        out = super().__call__(*args)
        self.switch(self.model, True)
        return out


class RemoteTeacher:
    """A vLLM server (OpenAI-compatible API). Per sequence we POST the token ids with
    prompt_logprobs=k; entry i of the answer holds the top-k of P(token_i | tokens < i), so
    student position i (which predicts token i + 1) lines up with entry i + 1. We send the
    targets' last token too, so every student position gets its entry."""

    def __init__(self, url, model, top_k=20, timeout=60.0, retries=3, backoff=1.0):
        self.url, self.model, self.top_k = url.rstrip('/') + '/v1/completions', model, top_k
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.n_layer = None

    def post(self, ids):
        body = {'model': self.model, 'prompt': ids, 'max_tokens': 1, 'temperature': 0, 'prompt_logprobs': self.top_k}
        for attempt in range(self.retries + 1):
            try:
                r = requests.post(self.url, json=body, timeout=self.timeout)
                r.raise_for_status()
                entries = r.json()['choices'][0]['prompt_logprobs']
                if len(entries) != len(ids):
                    raise ValueError(f"{len(entries)} prompt_logprobs for {len(ids)} tokens")
                return entries
            except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
                error = e
                if attempt < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
        raise RuntimeError(f"teacher server {self.url} failed after {self.retries + 1} tries ({error}); "
                           f"check that vLLM serves {self.model!r} there, with --max-logprobs >= {self.top_k}")

    def __call__(self, x, y, hidden=False, qkv_layer=None):
        """Top-k logprobs only (the manager refuses objectives that want features from a server)."""
        B, T = x.shape
        ids = torch.zeros(B, T, self.top_k, dtype=torch.long)
        logprobs = torch.full((B, T, self.top_k), -float('inf'))
        seqs = torch.cat((x, y[:, -1:].clamp(min=0)), dim=1).tolist()
        for b, seq in enumerate(seqs):
            for i, entry in enumerate(self.post(seq)[1:]):  # entry i + 1 -> student position i
                top = sorted(entry.items(), key=lambda kv: -kv[1]['logprob'])[:self.top_k]
                ids[b, i, :len(top)] = torch.tensor([int(k) for k, _ in top])
                logprobs[b, i, :len(top)] = torch.tensor([v['logprob'] for _, v in top])
        return {'topk_ids': ids.to(x.device), 'topk_logprobs': logprobs.to(x.device)}


class ObjectiveManager:
    """Runs one training micro-step's objectives: one shared student forward with the union of
    the features the active objectives want, one teacher forward if any of them needs it, each
    own-forward objective, and the weighted sum."""

    def __init__(self, objectives, curriculum, teacher=None, n_layer=None):
        self.objectives, self.curriculum, self.teacher = objectives, curriculum, teacher
        for name, obj in objectives.items():
            if obj.needs_teacher and teacher is None:
                raise ValueError(f"objective {name!r} needs a teacher; set teacher= in the config")
            if isinstance(teacher, RemoteTeacher) and (obj.features or obj.own_forward) and obj.needs_teacher:
                raise ValueError(f"objective {name!r} needs a local teacher; a remote one sends logprobs only")
            if hasattr(obj, 'bind'):
                obj.bind(n_layer, teacher.n_layer if isinstance(teacher, LocalTeacher) else n_layer)
        missing = set(curriculum.names) - set(objectives)
        if missing:
            raise ValueError(f"the curriculum weighs {sorted(missing)} but objectives only has {sorted(objectives)}")


    def __call__(self, model, batch, progress):
        weights = self.curriculum.weights(progress)
        active = {n: o for n, o in self.objectives.items() if weights.get(n, 0.0) > 0}
        if not active:
            raise ValueError(f"no objective weighs more than 0 at {progress:.0%} of training; fix the curriculum")
        shared = [o for o in active.values() if not o.own_forward]
        want = {k: v for o in shared for k, v in o.features.items()}
        hidden, layer = want.get('hidden', False), want.get('qkv_layer')
        losses = {}
        if shared:
            s = run_model(model, batch['x'], hidden, layer)
            t = None
            if any(o.needs_teacher for o in shared):
                t = self.teacher(batch['x'], batch['y'], hidden, want.get('teacher_qkv_layer'))
            losses = {n: o.loss(batch, s, t) for n, o in active.items() if not o.own_forward}
        for n, o in active.items():
            if o.own_forward:
                losses[n] = o.run(model, self.teacher, batch)
        total = sum(weights[n] * losses[n] for n in losses)
        metrics = {f'loss_{n}': v.detach() for n, v in losses.items()}
        metrics.update({f'w_{n}': w for n, w in weights.items()})
        return total, metrics


# -----------------------------------------------------------------------------
# optimisation: what a training step needs besides the losses, each a plain function of its inputs
# (parameter groups, AdamW or Muon (Jordan et al. 2024) with ZeRO-1 (Rajbhandari et al. 2020), the
# LR schedules beside the curriculum, ZClip (Kumar et al. 2025), the LR range test (Smith 2017),
# auto batch size, and the scores that remix a data mixture (data.Loader.reweight)), so that train.py stays a spine and each piece is tested alone

SCHEDULES = ('cosine', 'linear', 'constant', 'wsd', 'two_stage')


def param_groups(model, lr, weight_decay, embed_lr=0.0, head_lr=0.0, scalar_lr=0.0):
    """Groups with their own base LRs (0: lr): the hidden matrices (2-D, in the blocks), the
    embedding, an untied head, and the scalars (norm gains, biases), which are never decayed.
    Frozen parameters (a LoRA base) are left out: no optimizer state for them."""
    groups = {'hidden': [], 'embed': [], 'head': [], 'scalar': []}
    for name, p in ((n, p) for n, p in model.named_parameters() if p.requires_grad):
        kind = 'scalar' if p.dim() < 2 else {'embed_tokens': 'embed', 'lm_head': 'head'}.get(name.split('.')[0], 'hidden')
        groups[kind].append(p)
    lrs = {'hidden': lr, 'embed': embed_lr, 'head': head_lr, 'scalar': scalar_lr}
    return [{'params': ps, 'name': n, 'base_lr': lrs[n] or lr, 'weight_decay': 0.0 if n == 'scalar' else weight_decay}
            for n, ps in groups.items() if ps]


def make_optimizers(groups, kind='adamw', lr=1e-3, betas=(0.9, 0.95), zero1=False):
    """AdamW for every group, or Muon for the hidden matrices: it orthogonalises each update
    (Newton-Schulz), scaled by match_rms_adamw to take an AdamW-sized LR; the rest stays on AdamW.
    zero1: each rank keeps and updates the optimizer state of its share of the parameters."""
    if kind not in ('adamw', 'muon'):
        raise ValueError(f"optimizer={kind!r}; use adamw or muon")
    made = [(torch.optim.AdamW, [g for g in groups if kind == 'adamw' or g['name'] != 'hidden'],
             dict(lr=lr, betas=betas))]
    if kind == 'muon':
        made.append((torch.optim.Muon, [g for g in groups if g['name'] == 'hidden'],
                     dict(lr=lr, momentum=0.95, nesterov=True, adjust_lr_fn='match_rms_adamw')))
    if zero1:
        return [ZeroRedundancyOptimizer(g, optimizer_class=cls, **kw) for cls, g, kw in made]
    return [cls(g, **kw) for cls, g, kw in made]


def set_lr(optimizers, factor):
    """Every group's LR: its base LR times factor. Returns them, for the log."""
    for g in (g for opt in optimizers for g in opt.param_groups):
        g['lr'] = g['base_lr'] * factor
    return {f"lr_{g['name']}": g['lr'] for opt in optimizers for g in opt.param_groups}


def optimizer_step(optimizers, scaler, skip=False):
    """Each optimizer's step (none when skipped: a non-finite step), the fp16 gradient scaler's
    update, and the gradients cleared for the next step."""
    for opt in optimizers:
        if not skip:
            scaler.step(opt)
        opt.zero_grad(set_to_none=True)
    scaler.update()


def lr_factor(step, max_steps, warmup_steps, schedule='cosine', floor=0.1, decay_frac=0.2):
    """The LR of `step` as a fraction of each group's base LR; `floor` is min_lr / learning_rate.
    1) linear warmup over warmup_steps (and nothing else for 'constant');
    2) 'linear' or 'cosine' decay from 1 to floor over the remaining steps;
    3) 'wsd' (warmup-stable-decay): flat, then linear to floor over the last decay_frac of the steps;
    4) 'two_stage' (BitNet b1.58): cosine, halved from the midpoint on."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; use one of {', '.join(SCHEDULES)}")
    if step < warmup_steps or schedule == 'constant':
        return min(1.0, (step + 1) / max(1, warmup_steps))
    ratio = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == 'linear':
        return 1.0 - (1.0 - floor) * ratio
    if schedule == 'wsd':
        return 1.0 - (1.0 - floor) * max(0.0, (step - (1 - decay_frac) * max_steps) / (decay_frac * max_steps))
    cosine = floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)
    return cosine / 2 if schedule == 'two_stage' and step >= max_steps // 2 else cosine


class ZClip:
    """Adaptive gradient clipping: EMAs of the grad norm's mean and variance; a norm whose z-score
    exceeds z_thresh is a spike, clipped to mu + z_thresh^2 / z * sigma (the further out, the
    harder). The first `warmup` norms only seed the statistics, clipped at the fixed `max_norm`."""

    def __init__(self, z_thresh=2.5, alpha=0.97, warmup=25, max_norm=0.0):
        self.z_thresh, self.alpha, self.warmup, self.max_norm = z_thresh, alpha, warmup, max_norm
        self.norms, self.mu, self.var = [], 0.0, 0.0

    @property
    def adaptive(self):
        return len(self.norms) == self.warmup

    def target(self, g):
        """The norm to clip a finite norm g to (g itself when it is not a spike); updates the
        statistics. A non-finite norm must never reach it: its step is skipped, and a NaN mean
        would turn clipping off for good."""
        if not self.adaptive:
            self.norms.append(g)  # the raw norms: clipping them would bias the statistics low
            if self.adaptive:
                t = torch.tensor(self.norms, dtype=torch.float64)
                self.mu, self.var = t.mean().item(), t.var(unbiased=False).item()
            return min(g, self.max_norm or g)
        sigma = math.sqrt(self.var)
        z = (g - self.mu) / (sigma + 1e-6)
        clipped = self.mu + self.z_thresh ** 2 / z * sigma if z > self.z_thresh else g
        self.mu = self.alpha * self.mu + (1 - self.alpha) * clipped
        self.var = self.alpha * self.var + (1 - self.alpha) * (clipped - self.mu) ** 2
        return clipped


def lr_range_test(train_step, steps=100, lo=1e-8, hi=1.0):
    """LR range test: raise the LR exponentially from lo to hi, one optimizer step each (train_step(i, lr)
    takes step i at that LR and returns its loss), until the smoothed loss exceeds 4x its minimum.
    Returns the LRs, the smoothed losses and the suggestion: the LR where the loss fell fastest. The
    caller puts the model back afterwards."""
    lrs, losses, avg = [], [], 0.0
    for i in range(steps):
        lrs.append(lo * (hi / lo) ** (i / (steps - 1)))
        avg = 0.98 * avg + 0.02 * train_step(i, lrs[-1])
        losses.append(avg / (1 - 0.98 ** (i + 1)))  # bias-corrected EMA
        if not math.isfinite(losses[-1]) or losses[-1] > 4 * min(losses):
            break
    slopes = [(losses[i + 1] - losses[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1]) for i in range(1, len(lrs) - 1)]
    return lrs, losses, lrs[1 + min(range(len(slopes)), key=slopes.__getitem__)]


def write_svg(path, xs, ys, mark, W=480, H=300):
    """The LR range test's curve: smoothed loss against log10(LR), the suggestion in red."""
    lx, ys = [math.log10(x) for x in xs], [min(y, 4 * min(ys)) for y in ys]
    px = lambda v: 40 + (v - lx[0]) / (lx[-1] - lx[0]) * (W - 60)
    py = lambda v: H - 30 - (v - min(ys)) / (max(ys) - min(ys) + 1e-12) * (H - 60)
    points = ' '.join(f'{px(a):.1f},{py(b):.1f}' for a, b in zip(lx, ys))
    x = f'{px(math.log10(mark)):.1f}'
    with open(path, 'w') as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
                f'<rect width="100%" height="100%" fill="white"/>'
                f'<polyline fill="none" stroke="black" points="{points}"/>'
                f'<line x1="{x}" x2="{x}" y1="20" y2="{H - 30}" stroke="red"/><text x="45" y="15" font-size="11">'
                f'smoothed loss vs LR from {xs[0]:.0e} to {xs[-1]:.0e} (log scale); red: suggested {mark:.1e}</text></svg>')


def auto_batch_size(try_batch, start):
    """The largest batch size <= start (halving) for which try_batch(b) runs without running out of
    GPU memory."""
    for b in (start >> i for i in range(start.bit_length())):
        try:
            return try_batch(b) or b
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    return 1


def source_scores(model, loss_fn, batches, val_batches):
    """Influence-based remixing's score of each source: the cosine between the gradient of
    the loss on its batch and the gradient of the val loss. loss_fn(model, batch) returns a
    scalar; batches is {name: batch} (Loader.source_batches()), val_batches a list. The
    model's gradients are cleared after, so call it between optimizer steps. Under DDP pass
    the wrapped model: its gradients, hence the scores and the weights, agree on every rank."""
    params = [p for p in model.parameters() if p.requires_grad]

    def grad(bs):
        model.zero_grad(set_to_none=True)
        for b in bs:
            loss_fn(model, b).backward()
        return torch.cat([torch.zeros(p.numel(), device=p.device) if p.grad is None else p.grad.flatten().float() for p in params])

    g_val = grad(val_batches)
    scores = {name: F.cosine_similarity(grad([b]), g_val, dim=0).item() for name, b in batches.items()}
    model.zero_grad(set_to_none=True)
    return scores
