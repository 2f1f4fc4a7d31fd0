"""
BitLinear: the 1.58-bit linear layer of BitNet b1.58 (Ma et al. 2024, "The Era of 1-bit
LLMs"), and the conversion of a model to it.

A BitLinear keeps ordinary fp "latent" weights, and in every forward pass quantizes
- the weights to {-1, 0, +1} times one scale per matrix, gamma = mean(|W|) (absmean), and
- the activations to int8, with one scale per token, s = 127 / max(|x|) (absmax),
so that the matmul it computes is exactly what the int8 x ternary inference kernel computes:

    y = (x_q @ W_q^T) * gamma / s

Rounding has no gradient, so training uses the straight-through estimator (STE,
Bengio et al. 2013): the forward value is the quantized one, the backward pass treats the
quantizer as the identity, `x + (quant(x) - x).detach()`.

Quantization warmup: jumping from fp to ternary in one step throws a pretrained model
back to random-init loss. With `lam` in [0, 1] the layer computes
`x + lam * (quant(x) - x).detach()`, so lam = 0 is the fp layer, lam = 1 the ternary one,
and a trainer ramps lam up over the first steps.

Converting a model (`convert_to_bitnet`): every attention/MLP linear becomes a BitLinear
that keeps the same weights; embeddings and the LM head stay fp; and two RMSNorms with
gain 1 ("SubLN", Wang et al. 2023, used by BitNet b1.58 2B4T and BitDistill) go right
before o_proj and down_proj, whose inputs are otherwise badly scaled for int8.
This file needs only torch and can be copied into another project alone.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def weight_quant(w):
    """absmean: W_q = round(W / gamma) clipped to {-1, 0, 1}; gamma = mean|W| (fp32, clamped)."""
    gamma = w.float().abs().mean().clamp(min=1e-5)  # a clamp on the mean, not an added epsilon
    w_q = (w.float() / gamma).round().clamp(-1, 1)  # zero exactly when |w| < gamma / 2
    return w_q, gamma


def activation_quant(x):
    """absmax per token: x_q = round(x * s) clipped to int8's range; s = 127 / max|x| (fp32)."""
    s = 127 / x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)  # (..., 1)
    x_q = (x.float() * s).round().clamp(-128, 127)
    return x_q, s


class BitLinear(nn.Linear):
    """nn.Linear with fake-quantized (ternary) weights and int8 activations, trained with
    the STE. The weights it stores are the latent fp ones, so its state dict is that of an
    nn.Linear, which is what transformers' online BitNet format holds."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        # a tensor, not a float, so that changing it during warmup does not recompile
        self.register_buffer('lam', torch.ones((), device=device), persistent=False)
        self.lrc_u = self.lrc_v = None  # the optional low-rank correction, see add_lrc

    def forward(self, x):
        w_q, gamma = weight_quant(self.weight)
        w = self.weight + self.lam * (w_q * gamma - self.weight).detach()
        x_q, s = activation_quant(x)
        y = F.linear(x + (self.lam * (x_q / s - x.float())).to(x.dtype).detach(), w.to(x.dtype), self.bias)
        if self.lrc_u is not None:  # the correction sees the unquantized input
            y = y + F.linear(F.linear(x, self.lrc_v), self.lrc_u)
        return y


TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')


def convert_to_bitnet(module, eps=1e-5, targets=TARGETS):
    """In place: swap the nn.Linear children named in `targets` for BitLinears with the same
    weights, and turn Identity `attn_sub_norm` / `ffn_sub_norm` slots into RMSNorms."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) is nn.Linear:
                w = child.weight
                bit = BitLinear(child.in_features, child.out_features, child.bias is not None, w.device, w.dtype)
                bit.weight, bit.bias = child.weight, child.bias
                setattr(parent, name, bit)
        for norm, proj in (('attn_sub_norm', 'o_proj'), ('ffn_sub_norm', 'down_proj')):
            if isinstance(getattr(parent, norm, None), nn.Identity):
                w = getattr(parent, proj).weight
                setattr(parent, norm, nn.RMSNorm(w.shape[1], eps=eps, device=w.device, dtype=w.dtype))
    return module


def add_lrc(module, rank):
    """Low-rank correction (LRC): y = BitLinear(x) + U (V^T x), with fp factors U (out, r) and
    V^T (r, in) acting on the unquantized input. They start as the rank-r truncated SVD of
    the quantization residual W - gamma * W_q, so the layer starts as close to its fp self
    as rank r allows. (Both factors at zero would never move: each one's gradient is
    proportional to the other.)"""
    for m in module.modules():
        if isinstance(m, BitLinear):
            w_q, gamma = weight_quant(m.weight)
            U, S, Vh = torch.linalg.svd(m.weight.detach().float() - gamma * w_q, full_matrices=False)
            root = S[:rank].sqrt()  # split the singular values evenly between the factors
            m.lrc_u = nn.Parameter((U[:, :rank] * root).to(m.weight.dtype))
            m.lrc_v = nn.Parameter((root[:, None] * Vh[:rank]).to(m.weight.dtype))
    return module


def set_lambda(module, lam):
    """Set the quantization strength of every BitLinear: 0 = fp, 1 = fully ternary."""
    for m in module.modules():
        if isinstance(m, BitLinear):
            m.lam.fill_(lam)
