"""
BitLinear: the 1.58-bit linear layer of BitNet b1.58 (Ma et al. 2024, "The Era
of 1-bit LLMs"), and the conversion of a model to it.

A BitLinear keeps fp "latent" weights, and in every forward pass quantizes the weights
to {-1, 0, +1} times one scale per matrix, gamma = mean(|W|) (absmean), and the
activations to int8 with one scale per token, s = 127 / max(|x|) (absmax), so that it
computes exactly what the int8 x ternary inference kernel computes:
y = (x_q @ W_q^T) * gamma / s. Rounding has no gradient, so training uses the
straight-through estimator (STE, Bengio et al. 2013): the quantized value forward, the
identity's gradient backward. Quantization warmup: ternary at once throws a pretrained
model back to random-init loss, so the layer computes
`x + lam * (quant(x) - x).detach()` and a trainer ramps lam from 0 (fp) to 1 (ternary).

Converting a model (`convert_to_bitnet`): the attention/MLP linears become BitLinears
with the same weights (embeddings and LM head stay fp), and two RMSNorms ("SubLN",
Wang et al. 2023) go before o_proj and down_proj, whose inputs are badly scaled for
int8; ramped in with lambda and calibrated (`calibrate_subln`), they keep a converted
model at lambda = 0 exactly itself.

Freezing (`freeze`): each BitLinear becomes a PackedBitLinear that keeps only the 2-bit
weights and gamma (16x less memory than fp32) for the integer kernels of kernels.py. It
stays differentiable in its input, so adapters below it can train (lora.py). This file
needs only torch and can be copied alone; without kernels.py, packed layers unpack in
pure torch (same numbers, slower).
"""
import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook


# weights per scale block (weight_scale='block'): llama.cpp's TQ1_0/TQ2_0 store one scale
# per 256 weights of a row, as kernels.py's packed layout cuts rows into blocks of 256
BLOCK = 256


def weight_quant(w, scales='matrix'):
    """absmean: W_q = round(W / gamma) clipped to {-1, 0, 1}; gamma = mean|W| (fp32,
    clamped), one per matrix (shape ()), one per output row (N, 1), or one per row and
    block of 256 columns (N, K/256): finer scales, as ParetoQ (Liu et al. 2025) learns
    per channel; llama.cpp's ternary types store one scale per block of 256."""
    magnitudes = w.float().abs()
    if scales == 'matrix':
        mean = magnitudes.mean()
    elif scales == 'row':
        mean = magnitudes.mean(-1, keepdim=True)
    else:
        mean = magnitudes.unflatten(-1, (-1, BLOCK)).mean(-1)
    gamma = mean.clamp(min=1e-5)  # a clamp on the mean, not an added epsilon
    # zero exactly when |w| < gamma / 2
    w_q = (w.float() / per_weight(gamma, w.shape[-1])).round_().clamp_(-1, 1)
    return w_q, gamma


def per_weight(gamma, K):
    """gamma () or (N, 1) as it is; (N, K/256) repeated along K to (N, K): a shape that
    broadcasts against the weights."""
    if gamma.dim() < 2 or gamma.shape[1] == 1:
        return gamma
    return gamma.repeat_interleave(K // gamma.shape[1], dim=1)


def dequantize(w_q, gamma):
    """gamma * W_q, the ternary weights as numbers, for any of weight_quant's scales."""
    return w_q * per_weight(gamma, w_q.shape[-1])


def activation_quant(x):
    """absmax per token: x_q = round(x * s) clipped to int8's range; s = 127 / max|x|
    (fp32)."""
    # max|x| in one pass (abs, then amax, would write |x| out and read it again); exact in
    # any dtype, so rounding it to fp32 after is rounding every |x| before
    amax = torch.linalg.vector_norm(x, float('inf'), dim=-1, keepdim=True).float()
    s = 127 / amax.clamp(min=1e-5)  # (..., 1)
    x_q = (x.float() * s).round_().clamp_(-128, 127)
    return x_q, s


@functools.cache
def fused_activation_quant():
    """activation_quant as torch.compile fuses it: a reduction and one elementwise pass
    (eager: five passes), the same numbers. Made on first use: compiling costs seconds."""
    return torch.compile(activation_quant, dynamic=True)


def quantize_activations(x):
    """activation_quant, fused on CUDA; eager elsewhere (compiling takes about 20 s a
    graph on a CPU, where the tests run)."""
    return fused_activation_quant()(x) if x.is_cuda else activation_quant(x)


class SharedValue:
    """A value computed once for a tensor and kept while that tensor lives unchanged
    (its identity and version counter; in-place changes bump the version), for the next
    caller with the same tensor. q, k and v (gate and up) read one input: the first
    quantizes it and the others reuse its codes, and their backwards, which save those
    same codes, dequantize them once. One value at a time, dropped with its tensor."""

    def __init__(self):
        self.key = self.value = None

    def get(self, x, compute, *key):
        """compute(), or the value kept for this same x, unchanged, and key."""
        # compiled code is traced, not cached; inference tensors keep no version counter
        if torch.compiler.is_compiling() or x.is_inference():
            return compute()
        key = (x._version, *key)
        if self.key is None or self.key[0]() is not x or self.key[1:] != key:
            self.key = self.value = None  # the old value goes before the new one is made
            value = compute()
            self.key, self.value = (weakref.ref(x, self.forget), *key), value
        return self.value

    def forget(self, ref):  # the tensor died: so does its value
        if self.key is not None and self.key[0] is ref:
            self.key = self.value = None


shared_codes = SharedValue()  # x -> (x_q, s, x_q as int8), BitLinearFunction's forward
shared_inputs = SharedValue()  # int8 codes -> x_q / s, its backward


def quantize_input(x):
    """x (M, K) -> x_q (M, K) codes in fp32, s (M, 1), and the codes as int8."""
    x_q, s = quantize_activations(x)
    return x_q, s, x_q.to(torch.int8)


# Fused optimizers (AdamW(fused=True)) change weights without bumping their version counters,
# so every step of a torch optimizer counts here, and a quantized weight (see
# BitLinear.quantized_weight) from before the last step is not used again
optimizer_steps = 0


def count_optimizer_step(optimizer, args, kwargs):
    global optimizer_steps
    optimizer_steps += 1


register_optimizer_step_post_hook(count_optimizer_step)


def ste(x, value):
    """`value` forward, the identity's gradient (to x) backward: the STE
    (exact: x - x is 0)."""
    return value.detach() + (x - x.detach())


class BitLinear(nn.Linear):
    """nn.Linear with fake-quantized (ternary) weights and int8 activations, trained
    with the STE. It stores the latent fp weights: an nn.Linear's state dict,
    transformers' online format."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        # a tensor, not a float, so that changing it during warmup does not recompile
        self.register_buffer('lam', torch.ones((), device=device), persistent=False)
        self.ternary = True  # lam == 1: the int8 path
        self.lrc_u = self.lrc_v = None  # the optional low-rank correction, see add_lrc
        self.rms_norm = None  # the optional norm of its input, see add_input_norms
        self.scales = 'matrix'  # gamma per 'matrix', 'row' or 'block' (weight_quant)
        self.quantized = self.quantized_from = None  # see quantized_weight
        self.by_definition = False  # forward runs `reference` (use_reference)

    def use_reference(self, on=True):
        """Run the autograd definition `reference` instead of the int8 Function (to
        compare the two: bench.py train and curve)."""
        self.by_definition = on

    def quantized_weight(self):
        """W_q (int8) and gamma, quantized once per value of the weight and reused until
        it changes: by every micro-step of an optimizer step, by their backwards (which
        save this same int8 copy), by a frozen teacher's every forward. The value is
        known by the weight's identity, storage and version counter (which in-place
        changes bump: load_state_dict, an unfused optimizer) and the optimizer steps taken
        (fused optimizers bump no version). It costs one byte per weight, kept between
        steps. Compiled, the quantizer is traced into the graph instead."""
        w = self.weight
        if torch.compiler.is_compiling():
            w_q, gamma = weight_quant(w.detach(), self.scales)
            return w_q.to(torch.int8), gamma
        key = (w.data_ptr(), w._version, w.device, w.dtype, optimizer_steps)
        known = self.quantized_from is not None and self.quantized_from[0]() is w
        if not known or self.quantized_from[1] != key:
            w_q, gamma = weight_quant(w.detach(), self.scales)
            self.quantized = (w_q.to(torch.int8), gamma)
            self.quantized_from = (weakref.ref(w), key)
        return self.quantized

    def reference(self, x):
        """The definition: fake-quantize (blended with the fp values by lam),
        straight-through, F.linear. Fully ternary, the value is the integer product
        F.linear(x_q, W_q) * gamma / s (exact in fp32), as in the int8 kernel.
        F.linear(x_q / s, gamma * W_q) rounds differently in the last bit, which the
        next quantizer turns into other int8 codes now and then: 200 steps later such
        loss curves were 0.1-0.2 apart (bench.py curve). So the fast path equals the
        definition."""
        w_q, gamma = weight_quant(self.weight.detach(), self.scales)
        x_q, s = activation_quant(x.detach())
        # lerp is exact at lam = 1
        w = ste(self.weight, torch.lerp(self.weight.float(), dequantize(w_q, gamma), self.lam))
        y = F.linear(ste(x, torch.lerp(x.float(), x_q / s, self.lam)), w, self.bias)
        if self.ternary:
            with torch.autocast(x.device.type, enabled=False):  # exact, not rounded to bf16
                exact = scaled_product(F.linear, x_q, s, w_q, gamma)
            y = ste(y, exact if self.bias is None else exact + self.bias)
        return y.to(autocast_dtype(x.device.type) or x.dtype)

    def forward(self, x):
        if self.by_definition:
            return self.reference(x)
        if self.rms_norm is not None:
            x = self.rms_norm(x)
        w_q, gamma = self.quantized_weight()
        y = BitLinearFunction.apply(x, self.weight, self.bias, self.lam, self.ternary, w_q, gamma)
        if self.lrc_u is not None:  # the correction sees the unquantized input
            y = y + F.linear(F.linear(x, self.lrc_v), self.lrc_u)
        return y


# torch._int_mm is fast where there are int8 units: tensor cores, AVX-512 CPUs (VNNI). On an
# AVX2 CPU (AMD EPYC) it ran 18x slower than an fp32 matmul of the same integers
INT8_UNITS_ON_CPU = 'AVX512' in torch.backends.cpu.get_cpu_capability()


def has_int8_units(t):
    """Whether int8 matmuls on t's device run on int8 units."""
    return t.is_cuda or INT8_UNITS_ON_CPU


def int8_matmul(a, b):
    """a (M, K) @ b (N, K)^T for integer codes, exact in int32 (returned as fp32):
    torch._int_mm where a is int8 on int8 units and the shapes allow, else fp32
    (a may already hold its codes in fp32), exact too while K * 128 < 2^24 (with
    autocast off: it would round to bf16)."""
    fits = a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[0] % 8 == 0
    if a.dtype == torch.int8 and has_int8_units(a) and fits:
        return torch._int_mm(a, b.t()).float()
    with torch.autocast(a.device.type, enabled=False):
        return a.float() @ b.float().t()


def scaled_product(matmul, x_q, s, w_q, gamma):
    """The ternary product (x_q @ W_q^T) * gamma / s from the integer codes, `matmul`
    exact (int8_matmul, or F.linear without autocast). gamma () or (N, 1): one product,
    times gamma / s. gamma (N, K/256): each block of 256 columns' product times its
    gammas, the blocks added first to last, then divided by s (kernels.py computes it so
    too: the same bits)."""
    if gamma.dim() < 2 or gamma.shape[1] == 1:
        # in place: the matmul's own fresh output; gamma as a row
        return matmul(x_q, w_q).mul_(gamma.reshape(-1) / s)
    y = None
    for b, (x_b, w_b) in enumerate(zip(x_q.split(BLOCK, -1), w_q.split(BLOCK, -1))):
        part = matmul(x_b.contiguous(), w_b).mul_(gamma[:, b])
        y = part if y is None else y.add_(part)
    return y.div_(s)


def autocast_dtype(device_type):
    """The dtype autocast runs matmuls in on this device, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class BitLinearFunction(torch.autograd.Function):
    """`reference` as one autograd Function: the same numbers, bit for bit, faster and
    lighter. Autograd through `reference` keeps fp32 copies of the fake-quantized x and
    W and runs an fp32 matmul. Fully ternary, the forward is an integer matmul, and the
    STE gradients
        grad_x = grad_y @ (gamma * W_q)        grad_W = grad_y^T @ (x_q / s)
    need only x_q and W_q, saved as int8 (1 byte, not 4) with one scale per token.
    During warmup (lam < 1) it saves the fp32 blends, as autograd would.

    An autograd Function is opaque to autocast, so it follows autocast itself: under
    bf16/fp16 autocast its output is in that dtype and both backward matmuls run in it
    (on tensor cores, as F.linear's would), while the forward stays the exact integer
    product. Outside autocast everything is as above, in the input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, lam, ternary, w_q, gamma):
        """w_q (N, K) int8 and gamma (), (N, 1) or (N, K/256): the weight quantized
    (BitLinear.quantized_weight)."""
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        # (M, K), (M, 1), (M, K) int8: shared with the projections that read the same x
        x_q, s, x_int8 = shared_codes.get(x, lambda: quantize_input(x2))
        ctx.ternary, ctx.has_bias, ctx.w_dtype = ternary, bias is not None, weight.dtype
        ctx.x_dtype = x.dtype
        ctx.dtype = autocast_dtype(x.device.type) or x.dtype  # of the output and backward
        if ternary:
            ctx.save_for_backward(x_int8, s, w_q, gamma)
            # without int8 units the fp32 codes go to the fp32 matmul as they are
            codes = x_int8 if has_int8_units(x) else x_q
            y = scaled_product(int8_matmul, codes, s, w_q, gamma)  # (M, N)
            y = y if bias is None else y + bias
        else:
            x_f = torch.lerp(x2.float(), x_q / s, lam)
            w_f = torch.lerp(weight.float(), dequantize(w_q, gamma), lam)
            ctx.save_for_backward(x_f, w_f)
            y = F.linear(x_f, w_f, bias)
        return y.to(ctx.dtype).view(*x.shape[:-1], y.shape[-1])  # no -1: M may be 0

    @staticmethod
    def backward(ctx, grad_y):
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(ctx.dtype)  # (M, N)
        if ctx.ternary:
            x_q, s, w_q, gamma = ctx.saved_tensors
            # divide in fp32: in fp16 a token with max|x| < 1.9e-3 has s > 65504 = inf,
            # and x_q / s = 0
            x_f = shared_inputs.get(x_q, lambda: (x_q / s).to(g.dtype), g.dtype)
            w_f = dequantize(w_q, gamma.to(g.dtype))  # int8 * gamma: one pass
        else:
            x_f, w_f = (t.to(g.dtype) for t in ctx.saved_tensors)
        grad_x = (g @ w_f).view(*grad_y.shape[:-1], w_f.shape[-1])
        grad_w = g.t() @ x_f
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), grad_b, None, None, None, None


TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


class SubLN(nn.RMSNorm):
    """SubLN's RMSNorm, ramped in with the quantizers: lerp(x, rmsnorm(x), lam). At full
    strength in a pretrained model it rescales every input of o_proj and down_proj to
    unit RMS, which destroys it (SmolLM2-135M: 2.31 -> 16 nats per token held out).
    lam = 1 is transformers' BitNet norm (lam is not saved)."""

    def __init__(self, dim, eps=1e-5, device=None, dtype=None):
        super().__init__(dim, eps=eps, device=device, dtype=dtype)
        self.register_buffer('lam', torch.ones((), device=device), persistent=False)
        self.full = True  # lam == 1: the norm alone (the lerp would return it, bit for bit)

    def forward(self, x):
        if self.full:  # no blend pass forward, none backward
            return super().forward(x)
        return torch.lerp(x, super().forward(x), self.lam.to(x.dtype))


def convert_to_bitnet(module, eps=1e-5, targets=TARGETS, scales='matrix'):
    """In place: swap the nn.Linear children named in `targets` for BitLinears with the
    same weights (gamma per `scales`, see weight_quant), and turn Identity `attn_sub_norm` /
    `ffn_sub_norm` slots into SubLNs."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) is nn.Linear:
                if scales == 'block' and child.in_features % BLOCK:
                    raise ValueError(f"{name} has {child.in_features} inputs, no multiple "
                                     f"of {BLOCK}: use weight_scale='row', not 'block'")
                w = child.weight
                bit = BitLinear(child.in_features, child.out_features,
                                child.bias is not None, w.device, w.dtype)
                bit.weight, bit.bias = child.weight, child.bias
                bit.scales = scales
                setattr(parent, name, bit)
        for norm, proj in (('attn_sub_norm', 'o_proj'), ('ffn_sub_norm', 'down_proj')):
            if isinstance(getattr(parent, norm, None), nn.Identity):
                w = getattr(parent, proj).weight
                sub_norm = SubLN(w.shape[1], eps=eps, device=w.device, dtype=w.dtype)
                setattr(parent, norm, sub_norm)
    return module


def add_input_norms(module, eps=1e-5):
    """An RMSNorm (a SubLN: ramped in with lambda, calibrated with the others) on the
    input of every BitLinear, as BitDistill's code and transformers' `use_rms_norm` put
    one there. It is the BitLinear's `rms_norm` child, named as transformers names it."""
    for m in module.modules():
        if isinstance(m, BitLinear) and m.rms_norm is None:
            w = m.weight
            m.rms_norm = SubLN(m.in_features, eps=eps, device=w.device, dtype=w.dtype)
    return module


@torch.no_grad()
def calibrate_subln(model, batches):
    """Set each SubLN's gain so that at lam = 1 it changes its input as little as a gain
    can: per channel c, g_c = sum(u_c x_c) / sum(u_c^2) over the tokens of `batches`,
    u = x / rms(x) (least squares; gain 1 would rescale every channel to unit RMS). It
    runs at lambda 0, ends at 1."""
    norms = [m for m in model.modules() if isinstance(m, SubLN)]
    sums = {m: [0.0, 0.0] for m in norms}

    def record(m, args):
        x = args[0].float().flatten(0, -2)
        u = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + m.eps)
        sums[m][0] += (u * x).sum(0)
        sums[m][1] += u.square().sum(0)
    hooks = [m.register_forward_pre_hook(record) for m in norms]
    set_lambda(model, 0.0)
    try:
        for x in batches:
            model(x)
    finally:
        for h in hooks:
            h.remove()
        set_lambda(model, 1.0)
    for m, (ux, uu) in sums.items():
        if torch.is_tensor(uu):  # an expert the batches routed no token to keeps gain 1
            m.weight.copy_(ux / uu.clamp(min=1e-12))
    return model


def add_lrc(module, rank):
    """Low-rank correction (LRC): y = BitLinear(x) + U (V^T x), with fp factors U
    (out, r) and V^T (r, in) acting on the unquantized input. They start as the rank-r
    truncated SVD of the quantization residual W - gamma * W_q, so the layer starts as
    close to its fp self as rank r allows. (Both at zero would never move: each one's
    gradient is proportional to the other.)"""
    for m in module.modules():
        if isinstance(m, BitLinear):
            w_q, gamma = weight_quant(m.weight, m.scales)
            residual = m.weight.detach().float() - dequantize(w_q, gamma)
            U, S, Vh = torch.linalg.svd(residual, full_matrices=False)
            # split the singular values evenly between the factors
            root = S[:rank].sqrt()
            m.lrc_u = nn.Parameter((U[:, :rank] * root).to(m.weight.dtype))
            m.lrc_v = nn.Parameter((root[:, None] * Vh[:rank]).to(m.weight.dtype))
    return module


def set_lambda(module, lam):
    """Set the quantization strength of every BitLinear and SubLN: 0 = fp, 1 = fully
    ternary."""
    for m in module.modules():
        if isinstance(m, (BitLinear, SubLN)):
            m.lam.fill_(lam)
        if isinstance(m, BitLinear):
            m.ternary = lam >= 1
        if isinstance(m, SubLN):
            m.full = lam >= 1


# ------------------------------------------------------ inference: frozen 2-bit weights

# kernels.py, when it sits beside this file: the layout packed along K and fast
# int8 kernels
try:
    from kernels import pack, ternary_linear, unpack
    has_kernels = True
except ImportError:  # copied alone: keep the HF layout and unpack in pure torch
    has_kernels = False


def pack_hf(w_q):
    """(N, K) in {-1, 0, 1} -> uint8 (ceil(N/4), K), transformers' offline layout: code
    q + 1, row r holding rows r, r+R, r+2R, r+3R (the same as kernels.pack_hf, so this
    file works alone)."""
    N, R = w_q.shape[0], -(-w_q.shape[0] // 4)
    codes = F.pad(w_q.to(torch.int8) + 1, (0, 0, 0, 4 * R - N), value=1)
    c = codes.to(torch.uint8).view(4, R, -1)
    return c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6


def unpack_hf(packed, N):
    return torch.cat([packed >> 2 * i & 3 for i in range(4)])[:N].to(torch.int8) - 1


class PackedBitLinear(nn.Module):
    """A frozen BitLinear: 2-bit weights and gamma. In memory, kernels.py's layout when
    that file is there (else the HF one); the state dict is transformers' offline
    format: `weight` uint8 (ceil(out/4), in) in the HF layout, `weight_scale`
    (1,) = gamma, and `bias / gamma`, as its offline AutoBitLinear scales its output,
    bias included: (x_q @ W_q^T / s + bias) * gamma. (Our own formats: gamma (N,) per
    row; (N, K/256) per row and block, with the bias as it is.)"""

    def __init__(self, w_q, gamma, bias=None):
        super().__init__()
        self.out_features, self.in_features = w_q.shape
        self.register_buffer('weight', pack(w_q) if has_kernels else pack_hf(w_q))
        # (1,) per matrix, (N,) per row, (N, K/256) per row and block
        if gamma.dim() < 2 or gamma.shape[1] == 1:
            gamma = gamma.reshape(-1)
        self.register_buffer('weight_scale', gamma.float())
        self.bias = bias
        self.lrc_u = self.lrc_v = None
        self.rms_norm = None

    def w_q(self):  # W_q (out, in) as int8, unpacked from the layout in memory
        return unpack(self.weight, self.in_features) if has_kernels else \
            unpack_hf(self.weight, self.out_features)

    def matmul(self, x):
        if has_kernels:
            return ternary_linear(x, self.weight, self.weight_scale)
        # the same numbers: fp32 sums of integers below 2^24 are exact
        x_q, s = activation_quant(x.reshape(-1, self.in_features))
        gamma = self.weight_scale.float()
        y = scaled_product(F.linear, x_q, s, self.w_q().float(), gamma)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x):
        if self.rms_norm is not None:
            x = self.rms_norm(x)
        # through autograd only when x needs a gradient (adapters below it train), not
        # in decoding
        y = PackedFunction.apply(x, self) if x.requires_grad else self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        if self.lrc_u is not None:
            y = y + F.linear(F.linear(x, self.lrc_v), self.lrc_u)
        return y

    def _save_to_state_dict(self, dest, prefix, keep_vars):
        super()._save_to_state_dict(dest, prefix, keep_vars)
        if has_kernels:  # files hold the HF layout, whatever layout the kernels read
            dest[prefix + 'weight'] = pack_hf(self.w_q())
        # transformers' offline bias is divided by the one gamma of its row; block scales
        # (our own format) keep it as it is
        if self.bias is not None and self.weight_scale.dim() == 1:
            dest[prefix + 'bias'] = self.bias.detach() / self.weight_scale

    def _load_from_state_dict(self, sd, prefix, *args):
        w, b, gamma = (sd.get(prefix + k) for k in ('weight', 'bias', 'weight_scale'))
        hf_shape = (-(-self.out_features // 4), self.in_features)
        if has_kernels and w is not None and w.shape == hf_shape:
            sd[prefix + 'weight'] = pack(unpack_hf(w, self.out_features))
        if b is not None and gamma is not None and gamma.dim() == 1:
            sd[prefix + 'bias'] = b * gamma
        super()._load_from_state_dict(sd, prefix, *args)


class PackedFunction(torch.autograd.Function):
    """A packed layer, differentiable in x for the adapters below it (LoRA): the STE's
    grad_x = grad_y @ (gamma * W_q), as in BitLinearFunction. W_q is unpacked for one
    layer's backward and freed at once, so the base is never in fp32 as a whole. (grad_y
    is not int8, so the int8 kernels cannot compute it.)"""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.matmul(x)

    @staticmethod
    def backward(ctx, grad_y):
        m, g = ctx.layer, grad_y.reshape(-1, grad_y.shape[-1])  # (M, N)
        gamma = m.weight_scale.to(g.dtype)
        if gamma.dim() == 1:
            gamma = gamma.view(-1, 1)  # (1, 1) or (N, 1)
        grad_x = g @ dequantize(m.w_q().to(g.dtype), gamma)  # (M, K)
        return grad_x.view(*grad_y.shape[:-1], -1), None


@torch.no_grad()
def freeze(module):
    """In place: every BitLinear becomes a PackedBitLinear of its W_q and gamma
    (at any lambda)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BitLinear):
                w_q, gamma = weight_quant(child.weight, child.scales)
                packed = PackedBitLinear(w_q, gamma, child.bias)
                packed.lrc_u, packed.lrc_v = child.lrc_u, child.lrc_v
                packed.rms_norm = child.rms_norm
                setattr(parent, name, packed)
    return module
