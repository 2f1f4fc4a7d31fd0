"""
BitLinear: the 1.58-bit linear layer of BitNet b1.58 (Ma et al. 2024, "The Era of 1-bit
LLMs"), and the conversion of a model to it. Needs only torch: works copied alone.

1. The definition: weights to {-1, 0, +1} times gamma = mean|W| (`weight_quant`),
   activations to int8 with a scale per token (`activation_quant`), rounding passed over
   by the straight-through estimator (`ste`, Bengio et al. 2013): `BitLinear.reference`.
   lam ramps quantization in from fp (`set_lambda`); `convert_to_bitnet` puts SubLN
   (Wang et al. 2023) before o_proj and down_proj, calibrated by `calibrate_subln`.
2. The same numbers in less memory and time: `BitLinearFunction`, int8 codes saved for
   backward (`quantized_weight`, `exact_product`, `output_dtype`); faster with kernels.py.
3. Options: gamma per row (ParetoQ, Liu et al. 2025) or per row and `BLOCK` of 256
   inputs, as llama.cpp's TQ2_0 (`absmean`, `blocks_of`, `per_weight`, `check_scales`);
   an RMSNorm on each input (`normed`); a low-rank correction (`add_lrc`, `corrected`).
4. Pack and freeze: 2-bit weights for inference (`freeze`, `PackedBitLinear`).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # kernels.py beside this file: the same numbers, faster (part 2)
    import kernels
except ImportError:  # copied alone: everything in pure torch
    kernels = None


# ------------------------------------------------------------------ 1. the definition

def weight_quant(w, scales='matrix'):
    """absmean: W_q = round(W / gamma) clipped to {-1, 0, 1}, zero exactly where
    |w| < gamma / 2; gamma = mean|W| (fp32) of the matrix, or of each row or block."""
    gamma = absmean(w, scales)
    w_q = (w.float() / per_weight(gamma, w.shape[-1])).round_().clamp_(-1, 1)
    return w_q, gamma


def dequantize(w_q, gamma):
    """gamma * W_q, the ternary weights as numbers, for any of weight_quant's scales."""
    return w_q * per_weight(gamma, w_q.shape[-1])


def activation_quant(x):
    """absmax per token: x_q = round(x * s) clipped to int8; s = 127 / max|x| (fp32)."""
    # max|x| in one pass (not abs, then amax); exact in any dtype, so fp32 after is as before
    amax = torch.linalg.vector_norm(x, float('inf'), dim=-1, keepdim=True).float()
    s = 127 / amax.clamp(min=1e-5)  # (..., 1)
    x_q = (x.float() * s).round_().clamp_(-128, 127)
    return x_q, s


def ste(x, value):
    """The STE: `value` forward, the identity's gradient (to x) backward (x - x is 0)."""
    return value.detach() + (x - x.detach())


class BitLinear(nn.Linear):
    """nn.Linear with ternary weights and int8 activations, trained with the STE. Its state
    dict is an nn.Linear's (the latent fp weights), transformers' online format."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        # a tensor, not a float: changing it during warmup does not recompile
        self.register_buffer('lam', torch.ones((), device=device), persistent=False)
        self.full = True  # lam == 1: fully ternary, the int8 path
        self.scales = 'matrix'  # gamma per 'matrix', 'row' or 'block' (options)
        self.rms_norm = None  # the optional norm of its input (options)
        self.lrc_u = self.lrc_v = None  # the optional low-rank correction (options)

    def reference(self, x):
        """The definition: input norm; fake quantization blended by lam (lerp is exact at
        1), STE; low-rank correction. Fully ternary, the int8 kernel's exact product."""
        x = normed(self, x)
        w_q, gamma = weight_quant(self.weight.detach(), self.scales)
        x_q, s = activation_quant(x.detach())
        w = ste(self.weight, torch.lerp(self.weight.float(), dequantize(w_q, gamma), self.lam))
        y = F.linear(ste(x, torch.lerp(x.float(), x_q / s, self.lam)), w, self.bias)
        if self.full:  # the int8 kernel's exact product, the gradient of the line above
            y = ste(y, exact_product(x_q, s, w_q, gamma, self.bias))
        return corrected(self, x, y.to(output_dtype(x)))

    def forward(self, x):
        """`reference`'s numbers: itself during warmup, then BitLinearFunction."""
        if not self.full:
            return self.reference(x)
        x = normed(self, x)
        w_q, gamma = quantized_weight(self)
        return corrected(self, x, BitLinearFunction.apply(x, self.weight, self.bias, w_q, gamma))


TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


class SubLN(nn.RMSNorm):
    """lerp(x, rmsnorm(x), lam): at once it destroys a pretrained model (SmolLM2-135M: 2.31
    -> 16 nats per token held out). lam = 1 is transformers' BitNet norm."""

    def __init__(self, dim, eps=1e-5, device=None, dtype=None):
        super().__init__(dim, eps=eps, device=device, dtype=dtype)
        self.register_buffer('lam', torch.ones((), device=device), persistent=False)
        self.full = True  # lam == 1: the norm alone (the lerp returns it bit for bit)

    def forward(self, x):
        if self.full:  # no blend pass forward, none backward
            return super().forward(x)
        return torch.lerp(x, super().forward(x), self.lam.to(x.dtype))


def set_lambda(module, lam):
    """The quantization strength of every BitLinear and SubLN: 0 = fp, 1 = ternary."""
    for m in module.modules():
        if isinstance(m, (BitLinear, SubLN)):
            m.lam.fill_(lam)
            m.full = lam >= 1


def convert_to_bitnet(module, eps=1e-5, targets=TARGETS, scales='matrix', input_norms=False):
    """In place: the `targets` nn.Linears become BitLinears with the same weights, Identity
    `attn_sub_norm` / `ffn_sub_norm` slots SubLNs; input_norms: a SubLN on every BitLinear's
    input too, as BitDistill's code and transformers' `use_rms_norm` put one."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) is nn.Linear:
                check_scales(scales, name, child.in_features)
                w = child.weight
                bit = BitLinear(child.in_features, child.out_features,
                                child.bias is not None, w.device, w.dtype)
                bit.weight, bit.bias = child.weight, child.bias
                bit.scales = scales
                if input_norms:
                    bit.rms_norm = SubLN(bit.in_features, eps, w.device, w.dtype)
                setattr(parent, name, bit)
        for norm, proj in (('attn_sub_norm', 'o_proj'), ('ffn_sub_norm', 'down_proj')):
            if isinstance(getattr(parent, norm, None), nn.Identity):
                w = getattr(parent, proj).weight
                setattr(parent, norm, SubLN(w.shape[1], eps, w.device, w.dtype))
    return module


@torch.no_grad()
def calibrate_subln(model, batches):
    """Each SubLN's gain that changes its input least at lam = 1, by least squares per
    channel: g_c = sum(u_c x_c) / sum(u_c^2), u = x / rms(x), over the tokens of `batches`."""
    sums = {m: [0.0, 0.0] for m in model.modules() if isinstance(m, SubLN)}

    def record(m, args):
        x = args[0].float().flatten(0, -2)
        u = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + m.eps)
        sums[m][0] += (u * x).sum(0)
        sums[m][1] += u.square().sum(0)
    hooks = [m.register_forward_pre_hook(record) for m in sums]
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


# ------------------------------------------- 2. the same numbers in less memory and time

def output_dtype(x):
    """A BitLinear's output dtype: autocast's on x's device, else x's."""
    autocast = torch.is_autocast_enabled(x.device.type)
    return torch.get_autocast_dtype(x.device.type) if autocast else x.dtype


def reused(t, compute, *key):
    """compute(), or in kernels.holding_weights() the value kept for t, unchanged."""
    return kernels.reused(t, compute, *key) if kernels else compute()


def quantize_input(x):
    """activation_quant as int8 codes and scales; kernels.py fuses it on CUDA."""
    x_q, s = kernels.quantize_activations(x) if kernels else activation_quant(x)
    return x_q.to(torch.int8), s


def integer_matmul(a, b):
    """a (M, K) @ b (N, K)^T of int8 codes, exact (int8 units, or fp32 sums < 2^24)."""
    if kernels:
        return kernels.int8_matmul(a, b)
    with torch.autocast(a.device.type, enabled=False):
        return a.float() @ b.float().t()


def scaled_product(matmul, x_q, s, w_q, gamma):
    """(x_q @ W_q^T) * gamma / s from the integer codes, `matmul` exact. Block scales:
    each block's product times its gammas, added in order, then / s (as kernels.py)."""
    if blocks_of(gamma) == 1:
        return matmul(x_q, w_q).mul_(gamma.reshape(-1) / s)  # in place: a fresh output
    y = None
    for b, (x_b, w_b) in enumerate(zip(x_q.split(BLOCK, -1), w_q.split(BLOCK, -1))):
        part = matmul(x_b.contiguous(), w_b).mul_(gamma[:, b])
        y = part if y is None else y.add_(part)
    return y.div_(s)


def exact_product(x_q, s, w_q, gamma, bias=None):
    """(x_q @ W_q^T) * gamma / s (+ bias) as the int8 kernel computes it: in fp32 even
    under autocast (F.linear(x_q / s, gamma * W_q) rounds otherwise: bench.py curve)."""
    with torch.autocast(x_q.device.type, enabled=False):
        y = scaled_product(F.linear, x_q, s, w_q, gamma)
    return y if bias is None else y + bias


def quantized_weight(layer):
    """A BitLinear's W_q as int8 and gamma: once for all micro-steps in a hold."""
    def quantize():
        w_q, gamma = weight_quant(layer.weight.detach(), layer.scales)
        return w_q.to(torch.int8), gamma
    return reused(layer.weight, quantize, layer.scales)


class BitLinearFunction(torch.autograd.Function):
    """A fully ternary BitLinear.reference, bit for bit, in less memory: where autograd
    through the definition keeps fp32 copies of the fake-quantized x and W, the gradients
        grad_x = grad_y @ (gamma * W_q)        grad_W = grad_y^T @ (x_q / s)
    need x_q and W_q only, saved as int8; under autocast, output and backward in its dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, gamma):
        """w_q (N, K) int8 and gamma (), (N, 1) or (N, K/256): the weight quantized."""
        # q, k and v read one x: inside kernels.holding_weights() they share its codes
        x_q, s = reused(x, lambda: quantize_input(x.reshape(-1, x.shape[-1])))
        ctx.save_for_backward(x_q, s, w_q, gamma)  # int8 (M, K), (M, 1), int8 (N, K)
        ctx.has_bias, ctx.w_dtype, ctx.x_dtype = bias is not None, weight.dtype, x.dtype
        ctx.dtype = output_dtype(x)  # of the output and the backward
        y = scaled_product(integer_matmul, x_q, s, w_q, gamma)  # (M, N)
        y = y if bias is None else y + bias
        return y.to(ctx.dtype).view(*x.shape[:-1], y.shape[-1])  # no -1: M may be 0

    @staticmethod
    def backward(ctx, grad_y):
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(ctx.dtype)  # (M, N)
        x_q, s, w_q, gamma = ctx.saved_tensors
        # divide in fp32: in fp16 a token with max|x| < 1.9e-3 has s > 65504 = inf, and
        # x_q / s = 0; q, k and v saved the same codes: dequantized once
        x_f = reused(x_q, lambda: (x_q / s).to(g.dtype), g.dtype)
        w_f = dequantize(w_q, gamma.to(g.dtype))  # int8 * gamma: one pass
        grad_x = (g @ w_f).view(*grad_y.shape[:-1], w_f.shape[-1])
        grad_w = g.t() @ x_f
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), grad_b, None, None


# ------------------------------------------------------------------------- 3. options

BLOCK = 256  # weights per scale block: llama.cpp's TQ1_0/TQ2_0 scale each 256 of a row


def absmean(w, scales):
    """mean|W| (fp32), clamped at 1e-5 (not shifted): of the matrix (), of each row
    (N, 1) or of each row's blocks of BLOCK inputs (N, K/256)."""
    magnitudes = w.float().abs()
    if scales == 'matrix':
        return magnitudes.mean().clamp(min=1e-5)
    if scales == 'block':  # each row's blocks as rows of their own
        return magnitudes.unflatten(-1, (-1, BLOCK)).mean(-1).clamp(min=1e-5)
    return magnitudes.mean(-1, keepdim=True).clamp(min=1e-5)


def blocks_of(gamma):
    """How many blocks of each row gamma scales apart: 1 for a matrix's or a row's."""
    return 1 if gamma.dim() < 2 else gamma.shape[1]


def per_weight(gamma, K):
    """gamma in a shape that broadcasts against the (N, K) weights."""
    n = blocks_of(gamma)
    return gamma if n == 1 else gamma.repeat_interleave(K // n, dim=1)


def check_scales(scales, name, K):
    """A ValueError for block scales on K inputs, no multiple of BLOCK."""
    if scales == 'block' and K % BLOCK:
        raise ValueError(f"{name} has {K} inputs, no multiple of {BLOCK}: use weight_scale='row'")


def normed(layer, x):
    """The layer's input norm, if it has one (convert_to_bitnet's input_norms)."""
    return x if layer.rms_norm is None else layer.rms_norm(x)


def corrected(layer, x, y):
    """y plus the low-rank correction of the unquantized input x, if any (add_lrc)."""
    return y if layer.lrc_u is None else y + F.linear(F.linear(x, layer.lrc_v), layer.lrc_u)


def add_lrc(module, rank):
    """Low-rank correction (LRC): y = BitLinear(x) + U (V^T x), fp factors U (out, r) and
    V^T (r, in) on the unquantized input, starting as the rank-r SVD of the residual
    W - gamma * W_q, its singular values split evenly between the two (both at zero would
    never move: each one's gradient is the other's)."""
    for m in module.modules():
        if isinstance(m, BitLinear):
            w_q, gamma = weight_quant(m.weight, m.scales)
            residual = m.weight.detach().float() - dequantize(w_q, gamma)
            U, S, Vh = torch.linalg.svd(residual, full_matrices=False)
            root = S[:rank].sqrt()
            m.lrc_u = nn.Parameter((U[:, :rank] * root).to(m.weight.dtype))
            m.lrc_v = nn.Parameter((root[:, None] * Vh[:rank]).to(m.weight.dtype))
    return module


# ------------------------------------------------------------------ 4. pack and freeze

def pack_hf(w_q):
    """(N, K) in {-1, 0, 1} -> uint8 (ceil(N/4), K), transformers' offline layout (as
    kernels.pack_hf): code q + 1, row r holding rows r, r+R, r+2R, r+3R."""
    N, R = w_q.shape[0], -(-w_q.shape[0] // 4)
    codes = F.pad(w_q.to(torch.int8) + 1, (0, 0, 0, 4 * R - N), value=1)
    c = codes.to(torch.uint8).view(4, R, -1)
    return c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6


def unpack_hf(packed, N):
    return torch.cat([packed >> 2 * i & 3 for i in range(4)])[:N].to(torch.int8) - 1


class PackedFunction(torch.autograd.Function):
    """A packed layer, differentiable in x for adapters below it (LoRA): the STE's grad_x =
    grad_y @ (gamma * W_q), W_q unpacked for one backward and freed."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.matmul(x)

    @staticmethod
    def backward(ctx, grad_y):
        m, g = ctx.layer, grad_y.reshape(-1, grad_y.shape[-1])  # (M, N)
        gamma = m.weight_scale.to(g.dtype)  # (1,) or (N,) as a column; (N, K/256)
        gamma = gamma.view(-1, 1) if gamma.dim() == 1 else gamma
        grad_x = g @ dequantize(m.w_q().to(g.dtype), gamma)  # (M, K)
        return grad_x.view(*grad_y.shape[:-1], -1), None


class PackedBitLinear(nn.Module):
    """A frozen BitLinear: 2-bit weights (kernels.py's layout when it is there) and gamma;
    its state dict transformers' offline format: `weight` uint8 (ceil(out/4), in), gamma
    `weight_scale` (1,) or ours (N,) / (N, K/256), `bias / gamma` (AutoBitLinear's)."""

    def __init__(self, w_q, gamma, bias=None):
        super().__init__()
        self.out_features, self.in_features = w_q.shape
        self.register_buffer('weight', kernels.pack(w_q) if kernels else pack_hf(w_q))
        flat = blocks_of(gamma) == 1  # stored (1,) per matrix, (N,) per row
        self.register_buffer('weight_scale', (gamma.reshape(-1) if flat else gamma).float())
        self.bias = bias
        self.rms_norm = self.lrc_u = self.lrc_v = None

    def w_q(self):  # W_q (out, in) as int8, unpacked from the layout in memory
        return kernels.unpack(self.weight, self.in_features) if kernels else \
            unpack_hf(self.weight, self.out_features)

    def matmul(self, x):
        if kernels:
            return kernels.ternary_linear(x, self.weight, self.weight_scale)
        x_q, s = quantize_input(x.reshape(-1, self.in_features))
        y = scaled_product(integer_matmul, x_q, s, self.w_q(), self.weight_scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x):
        x = normed(self, x)
        # through autograd only when adapters below it train, not in decoding
        y = PackedFunction.apply(x, self) if x.requires_grad else self.matmul(x)
        return corrected(self, x, y if self.bias is None else y + self.bias)

    def _save_to_state_dict(self, dest, prefix, keep_vars):
        super()._save_to_state_dict(dest, prefix, keep_vars)
        if kernels:  # files hold the HF layout, whatever layout the kernels read
            dest[prefix + 'weight'] = pack_hf(self.w_q())
        # transformers' offline bias is bias / gamma of its row; block scales (ours) keep it
        if self.bias is not None and self.weight_scale.dim() == 1:
            dest[prefix + 'bias'] = self.bias.detach() / self.weight_scale

    def _load_from_state_dict(self, sd, prefix, *args):
        w, b, gamma = (sd.get(prefix + k) for k in ('weight', 'bias', 'weight_scale'))
        hf_shape = (-(-self.out_features // 4), self.in_features)
        if kernels and w is not None and w.shape == hf_shape:
            sd[prefix + 'weight'] = kernels.pack(unpack_hf(w, self.out_features))
        if b is not None and gamma is not None and gamma.dim() == 1:
            sd[prefix + 'bias'] = b * gamma
        super()._load_from_state_dict(sd, prefix, *args)


@torch.no_grad()
def freeze(module):
    """In place: every BitLinear becomes a PackedBitLinear of its W_q and gamma."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BitLinear):
                w_q, gamma = weight_quant(child.weight, child.scales)
                packed = PackedBitLinear(w_q, gamma, child.bias)
                packed.rms_norm = child.rms_norm
                packed.lrc_u, packed.lrc_v = child.lrc_u, child.lrc_v
                setattr(parent, name, packed)
    return module
