"""
Optimisation: what a training step needs besides the losses, each a plain function of
its inputs, so that train.py stays a spine and each piece is read and tested alone.

- Parameter groups with their own LRs: the hidden matrices, the embedding, an untied
  head, and the scalars (norm gains, biases), which are never decayed.
- AdamW, or Muon (Jordan et al. 2024) for the hidden matrices: it orthogonalises each
  update with a Newton-Schulz iteration; and ZeRO-1 (Rajbhandari et al. 2020), each rank
  keeping the optimizer state of its share of the parameters.
- LR schedules: warmup, then cosine, linear, constant, warmup-stable-decay, or BitNet
  b1.58's two stages.
- Gradient clipping, fixed or by ZClip (Kumar et al. 2025): adaptive clipping of
  gradient-norm spikes by their z-score.
- How the ranks share a step: DDP, or FSDP2 (weights, gradients and optimizer state
  sharded), checked and set up before the optimizers.
- The LR range test (Smith 2017), and the largest batch that fits on a GPU.
- The scores by which data.Loader.reweight remixes a data mixture.
"""
import math
import os

import torch
import torch.nn.functional as F

from report import Progress, write_svg

SCHEDULES = ('cosine', 'linear', 'constant', 'wsd', 'two_stage')


def param_groups(model, lr, weight_decay, embed_lr=0.0, head_lr=0.0, scalar_lr=0.0):
    """Groups with their own base LRs (0: lr): the hidden matrices (2-D, in the
    blocks), the embedding, an untied head, and the scalars (norm gains, biases), which
    are never decayed. Frozen parameters (a LoRA base) are left out: no optimizer state
    for them."""
    groups = {'hidden': [], 'embed': [], 'head': [], 'scalar': []}
    for name, p in ((n, p) for n, p in model.named_parameters() if p.requires_grad):
        module = name.split('.')[0]
        if p.dim() < 2:
            kind = 'scalar'
        else:
            kind = {'embed_tokens': 'embed', 'lm_head': 'head'}.get(module, 'hidden')
        groups[kind].append(p)
    lrs = {'hidden': lr, 'embed': embed_lr, 'head': head_lr, 'scalar': scalar_lr}
    return [{'params': ps, 'name': n, 'base_lr': lrs[n] or lr,
             'weight_decay': 0.0 if n == 'scalar' else weight_decay}
            for n, ps in groups.items() if ps]


def make_optimizers(groups, kind='adamw', lr=1e-3, betas=(0.9, 0.95), zero1=False):
    """AdamW for every group, or Muon for the hidden matrices: it orthogonalises each
    update (Newton-Schulz), scaled by match_rms_adamw to take an AdamW-sized LR; the
    rest stays on AdamW. zero1: each rank of the process group keeps and updates the
    optimizer state of its share of the parameters (alone, a process keeps it all)."""
    if kind not in ('adamw', 'muon'):
        raise ValueError(f"optimizer={kind!r}; use adamw or muon")
    rest = [g for g in groups if kind == 'adamw' or g['name'] != 'hidden']
    made = [(torch.optim.AdamW, rest, dict(lr=lr, betas=betas))]
    if kind == 'muon':
        hidden = [g for g in groups if g['name'] == 'hidden']
        args = dict(lr=lr, momentum=0.95, nesterov=True, adjust_lr_fn='match_rms_adamw')
        made.append((torch.optim.Muon, hidden, args))
    if zero1 and torch.distributed.is_initialized():
        # imported here: it takes a second, which every start of train.py would pay
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return [ZeroRedundancyOptimizer(g, optimizer_class=cls, **kw)
                for cls, g, kw in made]
    return [cls(g, **kw) for cls, g, kw in made]


def set_lr(optimizers, factor):
    """Every group's LR: its base LR times factor. Returns them, for the log."""
    for g in (g for opt in optimizers for g in opt.param_groups):
        g['lr'] = g['base_lr'] * factor
    return {f"lr_{g['name']}": g['lr'] for opt in optimizers for g in opt.param_groups}


def optimizer_step(optimizers, scaler, skip=False):
    """Each optimizer's step (none when skipped: a non-finite step), the fp16 gradient
    scaler's update, and the gradients cleared for the next step."""
    for opt in optimizers:
        if not skip:
            scaler.step(opt)
        opt.zero_grad(set_to_none=True)
    scaler.update()


def reset_moments(optimizers):
    """Forget every optimizer's state (AdamW's moments and step count, Muon's momentum):
    each parameter's next update starts as at step 1. A new curriculum phase calls it,
    since moments sized by the old phase's gradients would scale the new phase's steps:
    AdamW's second moments from block-wise reconstruction (gradient norm about 0.03) made
    the first CE + KD steps tens of times the LR's size."""
    for opt in optimizers:
        getattr(opt, 'optim', opt).state.clear()  # ZeRO-1 keeps its shard's in .optim


def drop_weight_decay(optimizers):
    """The second half of BitNet b1.58's two-stage schedule has no weight decay."""
    for opt in optimizers:
        for g in opt.param_groups:
            g['weight_decay'] = 0.0


def lr_factor(step, max_steps, warmup_steps, schedule='cosine', floor=0.1,
              decay_frac=0.2):
    """The LR of `step` as a fraction of each group's base LR;
    `floor` is min_lr / learning_rate.
    1) linear warmup over warmup_steps (and nothing else for 'constant');
    2) 'linear' or 'cosine' decay from 1 to floor over the remaining steps;
    3) 'wsd' (warmup-stable-decay): flat, then linear to floor over the last decay_frac
       of the steps;
    4) 'two_stage' (BitNet b1.58): cosine, halved from the midpoint on."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; use one of {', '.join(SCHEDULES)}")
    if step < warmup_steps or schedule == 'constant':
        return min(1.0, (step + 1) / max(1, warmup_steps))
    ratio = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == 'linear':
        return 1.0 - (1.0 - floor) * ratio
    if schedule == 'wsd':
        decay_start = (1 - decay_frac) * max_steps
        decayed = max(0.0, (step - decay_start) / (decay_frac * max_steps))
        return 1.0 - (1.0 - floor) * decayed
    cosine = floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)
    return cosine / 2 if schedule == 'two_stage' and step >= max_steps // 2 else cosine


class ZClip:
    """Adaptive gradient clipping: EMAs of the grad norm's mean and variance; a norm
    whose z-score exceeds z_thresh is a spike, clipped to mu + z_thresh^2 / z * sigma
    (the further out, the harder). The first `warmup` norms only seed the statistics,
    clipped at the fixed `max_norm`."""

    def __init__(self, z_thresh=2.5, alpha=0.97, warmup=25, max_norm=0.0):
        self.z_thresh = z_thresh
        self.alpha = alpha
        self.warmup = warmup
        self.max_norm = max_norm
        self.norms, self.mu, self.var = [], 0.0, 0.0

    @property
    def adaptive(self):
        return len(self.norms) == self.warmup

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        vars(self).update(state)

    def target(self, g):
        """The norm to clip a finite norm g to (g itself when it is not a spike);
        updates the statistics. A non-finite norm must never reach it: its step is
        skipped, and a NaN mean would turn clipping off for good."""
        if not self.adaptive:
            # the raw norms: clipping them would bias the statistics low
            self.norms.append(g)
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


def clip_gradients(model, optimizers, scaler, max_norm=0.0, zclip=None):
    """Unscale the gradients (fp16), then clip their total norm to max_norm (0: no
    limit), or to what ZClip says for a spike. Returns the norm and the norm ZClip
    clipped a spike to (None when it clipped none). A non-finite norm clips nothing,
    and ZClip never sees it: the caller skips that step, and a NaN in ZClip's statistics
    would turn spike clipping off for the rest of the run."""
    for opt in optimizers:
        scaler.unscale_(opt)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, 'full_tensor'):  # a DTensor (FSDP): the norm of every rank's shards together
        norm = norm.full_tensor()
    adaptive = zclip is not None and zclip.adaptive
    finite = math.isfinite(norm.item())  # a CPU-GPU sync
    target = max_norm or float('inf')
    if zclip and finite:
        target = zclip.target(norm.item())
    if finite and norm.item() > target:
        torch.nn.utils.clip_grads_with_norm_(params, target, norm)
    return norm, target if adaptive and target < norm.item() else None


def lr_range_test(train_step, steps=100, lo=1e-8, hi=1.0):
    """LR range test: raise the LR exponentially from lo to hi, one optimizer step each
    (train_step(i, lr) takes step i at that LR and returns its loss), until the smoothed
    loss exceeds 4x its minimum. Returns the LRs, the smoothed losses and the
    suggestion: the LR where the loss fell fastest. The caller puts the model back
    afterwards."""
    lrs, losses, avg = [], [], 0.0
    for i in range(steps):
        lrs.append(lo * (hi / lo) ** (i / (steps - 1)))
        avg = 0.98 * avg + 0.02 * train_step(i, lrs[-1])
        losses.append(avg / (1 - 0.98 ** (i + 1)))  # bias-corrected EMA
        if not math.isfinite(losses[-1]) or losses[-1] > 4 * min(losses):
            break
    slopes = [(losses[i + 1] - losses[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(1, len(lrs) - 1)]
    return lrs, losses, lrs[1 + min(range(len(slopes)), key=slopes.__getitem__)]


def find_lr(train_step, out_dir, model, verbose=True):
    """The LR range test as a run uses it: a progress line, the curve drawn to
    out_dir/lr_find.svg and the suggestion printed (when verbose: rank 0); the model's
    weights are put back afterwards. Returns the suggested LR."""
    show = Progress('lr_find', 100, ' steps', 1, delay=2 if verbose else math.inf)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def step(i, lr):
        show(i + 1)
        return train_step(i, lr)
    tried, losses, found = lr_range_test(step)
    model.load_state_dict(saved)
    show(len(tried), last=True)
    if verbose:
        curve = ([math.log10(lr) for lr in tried], [min(y, 4 * min(losses)) for y in losses])
        write_svg(os.path.join(out_dir, 'lr_find.svg'), {'smoothed loss': curve},
                  f'smoothed loss vs log10 LR, {tried[0]:.0e} to {tried[-1]:.0e}; '
                  f'red: suggested {found:.1e}', mark=math.log10(found))
        print(f"lr_find: suggested learning_rate {found:.2e} (steepest descent); "
              f"curve in {out_dir}/lr_find.svg")
    return found


def auto_batch_size(try_batch, start):
    """The largest batch size <= start (halving) for which try_batch(b) runs without
    running out of GPU memory."""
    for b in (start >> i for i in range(start.bit_length())):
        try:
            return try_batch(b) or b
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    return 1


def saved_bytes(fn):
    """Run fn(); the bytes of the tensors its autograd graph kept for backward (each
    storage once): a micro-step's activations, measured the same way on any device."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def check_fits(config, batch_size, block_size, device, eval_iters=1):
    """A ValueError, before any batch is made, for a micro-batch that cannot fit: one
    micro-step holds at least its ids and targets (int64) and every layer's input for
    backward (2 bytes a number at the least), a floor well under the true need; or for
    an evaluation's eval_iters batches (made at once, ids and targets) past the RAM."""
    tokens = batch_size * block_size
    least = tokens * (2 * 8 + config.n_layer * config.n_embd * 2)
    if torch.device(device).type == 'cuda':
        memory, where = torch.cuda.mem_get_info(device)[1], f"{device}'s memory"
    else:
        memory, where = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'), 'the RAM'
    if least > memory:
        raise ValueError(f"batch_size={batch_size} x block_size={block_size} needs over "
                         f"{least / 2**30:,.1f} GiB a micro-step, more than {where} "
                         f"({memory / 2**30:,.1f} GiB); lower batch_size and raise "
                         "gradient_accumulation_steps")
    ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    held = eval_iters * tokens * 2 * 8
    if held > ram:
        raise ValueError(f"eval_iters={eval_iters} batches of {tokens:,} tokens hold "
                         f"{held / 2**30:,.1f} GiB at an evaluation, more than the RAM "
                         f"({ram / 2**30:,.1f} GiB); lower eval_iters")


def largest_batch(model, manager, make_batch, ctx, batch_size, accumulation, device, gib=0.0,
                  verbose=True):
    """(micro-batch, accumulation steps) for train.py's auto_batch: the largest micro-batch
    that fits (fit_batch), found by one forward and backward of the run's own kind of
    batch (make_batch(b)) through the objectives' `manager`; with `gib`, the largest that
    keeps at most that many GiB for backward (on any device). On a CPU without `gib`
    there is no limit to probe: the batch is kept as it is."""
    if torch.device(device).type != 'cuda' and not gib:
        print("auto_batch: nothing to do on CPU (no memory limit to probe); set "
              "auto_batch.gib")
        return batch_size, accumulation
    kept = {}  # GiB a micro-step of b sequences keeps for backward

    def try_batch(b):
        """One micro-step of b sequences; a memory error when it does not fit."""
        batch = make_batch(b)

        def micro_step():
            with ctx:
                manager(model, batch, 1.0)[0].backward()
        kept[b] = saved_bytes(micro_step) / 2**30
        model.zero_grad(set_to_none=True)
        if gib and kept[b] > gib:
            raise torch.OutOfMemoryError(f"{kept[b]:.4f} GiB kept for backward")
    batch_size, accumulation = fit_batch(try_batch, batch_size, accumulation, device)
    if verbose:
        print(f"auto_batch: batch_size={batch_size} x {accumulation} accumulation steps "
              f"({kept.get(batch_size, 0):.6f} GiB kept for backward)")
    return batch_size, accumulation


def fit_batch(try_batch, batch_size, accumulation, device):
    """(micro-batch, accumulation steps) for a run that wants batch_size x accumulation
    sequences per rank and step: the largest power of two up to that which fits, the
    smallest over the ranks, since every rank must run the same number of micro-steps."""
    wanted = batch_size * accumulation
    largest = auto_batch_size(try_batch, 2 ** math.floor(math.log2(wanted)))
    fits = torch.tensor(largest, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN)
    return fits.item(), max(1, wanted // fits.item())


def join_ranks(device):
    """(ddp, rank, local rank, world size, device) of this process: under torchrun (which
    sets RANK, LOCAL_RANK and WORLD_SIZE) the process group joined, nccl on CUDA (each
    rank on its own GPU) and gloo on CPU; alone, rank 0 of 1 on `device`. A ValueError
    for a CUDA device where torch sees no GPU."""
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this torch sees no CUDA GPU; "
                         "set --device=cpu")
    if 'RANK' not in os.environ:
        return False, 0, 0, 1, device
    torch.distributed.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    local_rank = int(os.environ['LOCAL_RANK'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return True, rank, local_rank, world_size, device


def rank_mean(x):
    """The mean of tensor x over the ranks, in place (x itself when alone): every rank
    logs the same."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.AVG)
    return x


def check_sharding(fsdp, zero1, ddp, optimizer, lr_find, cpu_compile, block_objective):
    """A ValueError for ways of sharing a step over ranks that cannot work: FSDP2 runs
    under torchrun, with AdamW (Muon needs whole matrices), without ZeRO-1, the LR finder
    or compile on CPU; block-wise distillation's losses reach DDP only under FSDP."""
    if fsdp and (not ddp or zero1 or lr_find or optimizer != 'adamw' or cpu_compile):
        raise ValueError("fsdp=True runs under torchrun, with AdamW, and without zero1, "
                         "lr_find or compile on CPU (Muon needs whole matrices); drop one "
                         "of them")
    if ddp and not fsdp and block_objective:  # DDP follows the logits' graph only
        raise ValueError("objective 'block' runs on several ranks under fsdp=True only; "
                         "add --fsdp=True")


def distribute(model, fsdp=False, ddp=False, compile=False, dtype=torch.float32,
               local_rank=0):
    """The model a training step runs: under FSDP2 every block and then the whole model
    sharded over the ranks (rank 0's weights everywhere; each block gathered for its
    forward and backward, then freed; on a GPU computed in `dtype`, gradients reduced in
    fp32), compiled when asked, and wrapped in DDP (ddp) to all-reduce the gradients."""
    device_type = next(model.parameters()).device.type
    if fsdp:
        # imported here, not at the top: it takes seconds, which every run would pay
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        for v in model.state_dict().values():  # rank 0's weights everywhere, as DDP does
            torch.distributed.broadcast(v, 0)
        policy = MixedPrecisionPolicy()  # fp32 on the CPU
        if device_type == 'cuda':
            policy = MixedPrecisionPolicy(dtype, torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    if compile:
        model = torch.compile(model)
    if ddp:
        device_ids = [local_rank] if device_type == 'cuda' else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def source_scores(model, loss_fn, batches, val_batches):
    """Influence-based remixing's score of each source: the cosine between the gradient
    of the loss on its batch and the gradient of the val loss. loss_fn(model, batch)
    returns a scalar; batches is {name: batch} (Loader.source_batches()), val_batches a
    list. The model's gradients are cleared after, so call it between optimizer steps.
    Under DDP pass the wrapped model: its gradients, hence the scores and the weights,
    agree on every rank."""
    params = [p for p in model.parameters() if p.requires_grad]

    def grad(bs):
        model.zero_grad(set_to_none=True)
        for b in bs:
            loss_fn(model, b).backward()
        flat = [torch.zeros(p.numel(), device=p.device) if p.grad is None
                else p.grad.flatten().float() for p in params]
        return torch.cat(flat)

    g_val = grad(val_batches)
    scores = {name: F.cosine_similarity(grad([b]), g_val, dim=0).item()
              for name, b in batches.items()}
    model.zero_grad(set_to_none=True)
    return scores


def remix_mixture(model, loss_fn, loader, val_batches, eta=1.0, floor=0.05):
    """Influence-based remixing: the loader's sources reweighed by their source_scores
    (data.Loader.reweight); the new weights as {'mix_<source>': weight}."""
    scores = source_scores(model, loss_fn, loader.source_batches(), val_batches)
    weights = loader.reweight(scores, eta, floor)
    return {f'mix_{n}': w for n, w in weights.items()}
