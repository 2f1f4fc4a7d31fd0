"""
A Llama-family decoder, written out by hand so that every line can be read.

The architecture is the one shared by Llama 2/3, SmolLM2 and (with two extra norms and
ternary linears) BitNet b1.58 2B4T:

    x = embed(idx)
    for each block:
        x = x + o_proj(sub_norm(attention(rope(q), rope(k), v)))     q, k, v from norm(x)
        x = x + down_proj(sub_norm(act(gate_proj(h)) * up_proj(h)))  h = norm(x)
    logits = lm_head(norm(x))

- RMSNorm instead of LayerNorm, rotary position embeddings (RoPE, Su et al. 2021:
  `apply_rope`, `rope_frequencies`), grouped-query attention (GQA, Ainslie et al. 2023)
  through PyTorch's SDPA kernel, and a gated MLP with SiLU (Llama) or ReLU^2.
- SubLN: the two `*_sub_norm` RMSNorms are Identity in a plain Llama. BitNet inserts them
  before the output projections so that the activations entering the ternary o_proj and
  down_proj are well scaled (Wang et al. 2023; see bitlinear.py).
- Module names are the Hugging Face ones (`q_proj`, `input_layernorm`, ...), so that
  `from_pretrained` and `save_pretrained` (hf_layout.py) map a checkpoint's tensors onto
  ours: transformers opens what they write as the family's class (fp) or as
  `BitNetForCausalLM` (ternary, latent weights, or after `freeze()` packed 2-bit ones).
- Each MLP can be a mixture of experts (moe.py): gated MLPs, ternary when the model is,
  behind an fp router; an fp MoE opens in transformers as `Qwen2MoeForCausalLM`.
- The forward takes a KV cache and a position for inference (engine.py), a mask of the
  real tokens of left-padded rows (batched sampling for RL), and fills a `feats` dict
  with what distillation and the router losses ask for (objectives.py); it always
  returns the logits, in training only where a loss reads them.
"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_layout
from bitlinear import SubLN, add_lrc, calibrate_subln, convert_to_bitnet, freeze
from hf_layout import FAMILIES
from moe import MoE, upcycle


@dataclass
class ModelConfig:
    vocab_size: int = 320
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv_head: int = 4
    head_dim: int = 0            # 0 means n_embd // n_head
    intermediate_size: int = 688
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048      # length of the precomputed RoPE table
    tie_embeddings: bool = True
    act: str = 'silu'            # 'silu' (Llama, SmolLM2) or 'relu2' (BitNet b1.58 2B4T)
    attention_bias: bool = False  # q/k/v and o_proj biased (Llama's attention_bias)
    qkv_bias: bool = False       # q/k/v biased, o_proj not (Qwen2)
    qk_norm: bool = False        # an RMSNorm on each head's q and k before RoPE (Qwen3)
    sliding_window: int = 0      # each token sees the last this many (Mistral; 0: all)
    rope_scaling: dict = None    # Llama 3's ('llama3') or linear RoPE scaling, as in
                                 # config.json (None: none)
    family: str = 'llama'        # the Hugging Face model_type it loads from and saves as:
                                 # 'llama', 'mistral', 'qwen2' or 'qwen3'
    subln: bool = False          # BitNet's two extra RMSNorms (on when bitnet)
    bitnet: bool = False         # attention/MLP linears are ternary BitLinear
    linear_norm: bool = False    # ... each with an RMSNorm on its input (BitDistill's;
                                 # transformers' use_rms_norm)
    weight_scale: str = 'matrix'  # ... gamma per 'matrix', per output 'row', or per row
                                  # and 'block' of 256 inputs (widths multiples of 256)
    lrc_rank: int = 0            # each BitLinear's low-rank correction's rank (0: none)
    packed: bool = False         # BitLinears frozen to 2-bit ones (inference only)
    n_experts: int = 0           # mixture of experts: routed experts per MLP (0: dense)
    top_k: int = 2               # ... the experts each token is routed to
    n_shared_experts: int = 0    # ... the width of the shared expert every token passes
                                 # through, in experts (0: none)
    norm_topk_prob: bool = True  # ... the top_k routing weights renormalised to sum to 1
    moe_intermediate_size: int = 0  # ... each expert's hidden size (0: intermediate_size)
    bos_token_id: int = None     # the tokenizer's; written to config.json even when
    eos_token_id: int = None     # None, since transformers would otherwise assume its
                                 # own (eos 2, a byte here)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is no multiple of "
                             f"n_kv_head {self.n_kv_head}")
        if self.act not in ('silu', 'relu2'):
            raise ValueError(f"act={self.act!r} is not supported; use 'silu' or 'relu2'")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and "
                             f"n_experts={self.n_experts}")
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; "
                             f"use one of {', '.join(FAMILIES)}")
        for switch, value in FAMILIES[self.family][1].items():
            if getattr(self, switch) != value:
                raise ValueError(f"family={self.family!r} has {switch}={value}; "
                                 f"set it so or pick another family")
        if self.weight_scale not in ('matrix', 'row', 'block'):
            raise ValueError(f"weight_scale={self.weight_scale!r}; "
                             "use 'matrix', 'row' or 'block'")
        hidden = self.moe_intermediate_size if self.n_experts else self.intermediate_size
        inputs = {self.n_embd, self.n_head * self.head_dim, hidden}  # of q, o and down_proj
        if self.weight_scale == 'block' and any(k % 256 for k in inputs):
            raise ValueError(f"weight_scale='block' needs every linear's input width a "
                             f"multiple of 256, and this model's are "
                             f"{sorted(inputs)}: use 'row'")
        if self.sliding_window and self.family != 'mistral':
            raise ValueError("sliding_window is Mistral's; set family='mistral' or "
                             "sliding_window=0")
        rope_frequencies(2, 1.0, self.rope_scaling)  # checks the scaling's kind


class Attention(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        C, bias = cfg.n_embd, cfg.attention_bias
        qkv_bias = bias or cfg.qkv_bias
        heads = cfg.n_head * cfg.head_dim  # o_proj's input, which may differ from C
        self.q_proj = nn.Linear(C, heads, bias=qkv_bias)
        self.k_proj = nn.Linear(C, cfg.n_kv_head * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(C, cfg.n_kv_head * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads, C, bias=bias)
        self.attn_sub_norm = SubLN(heads, eps=cfg.norm_eps) if cfg.subln else nn.Identity()
        if cfg.qk_norm:  # one gain per channel of a head, shared by all heads
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def projections(self, x):
        """q (B, T, nh*hs), k and v (B, T, nkv*hs) of x (B, T, C)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def heads(self, x, cos, sin, qkv=None):
        """The queries (B, nh, T, hs), keys and values (B, nkv, T, hs) of x (B, T, C),
        RoPE applied to the queries and keys."""
        B, T, _ = x.shape
        q, k, v = self.projections(x)
        # hand the projections' outputs to attention-relation distillation
        if qkv is not None:
            qkv += [q, k, v]
        # (B, T, nh*hs) -> (B, nh, T, hs); K and V have fewer (shared) heads under GQA
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cache=None, pos=0, causal=True, qkv=None, mask=None):
        B, T, _ = x.shape
        q, k, v = self.heads(x, cos, sin, qkv)
        # write this step's K/V, then attend over everything so far
        if cache is not None:
            cache[0][:, :, pos:pos + T], cache[1][:, :, pos:pos + T] = k, v
            k, v = cache[0][:, :, :pos + T], cache[1][:, :, :pos + T]
        # a single new token may look at the whole cache, so only a multi-token step is
        # causal; causal=False is the bidirectional attention of masked diffusion; a
        # mask (Transformer.forward: padding, a sliding window) holds the causal rule itself
        is_causal = causal and T > 1 and mask is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.o_proj(self.attn_sub_norm(y))


class MLP(nn.Module):

    def __init__(self, cfg, hidden=None):
        super().__init__()
        C, H = cfg.n_embd, hidden or cfg.intermediate_size
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)
        self.ffn_sub_norm = SubLN(H, eps=cfg.norm_eps) if cfg.subln else nn.Identity()
        self.act = F.silu if cfg.act == 'silu' else lambda g: F.relu(g).square()

    def gate_and_up(self, x):
        """The two projections of x the gate multiplies: gate_proj(x) and up_proj(x)."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        g, u = self.gate_and_up(x)
        return self.down_proj(self.ffn_sub_norm(self.act(g) * u))


class Block(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MoE(cfg, lambda hidden: MLP(cfg, hidden)) if cfg.n_experts else MLP(cfg)

    def forward(self, x, cos, sin, cache=None, pos=0, causal=True, qkv=None, mask=None,
                router=None):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, cache, pos, causal, qkv, mask)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            return x + self.mlp(h, router)
        return x + self.mlp(h)


def attention_mask(valid, pos, T, window, device):
    """(B or 1, 1, T, pos + T) attention mask for queries at pos..pos + T - 1, or None
    where SDPA's own causal rule is all there is: a key at or before the query, within
    the last `window` positions (a sliding window, 0: all), and real (`valid`, (B, pos +
    T)). A padding position also sees itself, so that no row of the softmax is empty
    (NaN); nothing real ever looks at it."""
    windowed = window and pos + T > window
    if valid is None and not windowed:
        return None
    keys = torch.arange(pos + T, device=device)
    queries = pos + torch.arange(T, device=device)[:, None]
    seen = keys <= queries  # (T, pos + T)
    if windowed:
        seen = seen & (keys > queries - window)
    if valid is not None:
        seen = valid[:, None, :] & seen | (keys == queries)  # (B, T, pos + T)
    return seen[:, None] if seen.dim() == 3 else seen[None, None]


def rope_frequencies(head_dim, theta, scaling=None):
    """The rotation speed of each pair, theta^(-2i/d) (in fp32, as in Llama), scaled
    for a longer context: 'linear' divides every speed by `factor` (Chen et al. 2023,
    position interpolation); 'llama3' (Llama 3.1) divides the slow ones, whose
    wavelength exceeds original_max_position_embeddings / low_freq_factor, keeps the
    fast ones (wavelength under ... / high_freq_factor) and blends in between."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / theta ** exponents
    kind = (scaling or {}).get('rope_type', (scaling or {}).get('type', 'default'))
    if kind == 'default':
        return inv_freq
    if kind == 'linear':
        return inv_freq / scaling['factor']
    if kind != 'llama3':
        raise ValueError(f"rope_scaling {kind!r} is not supported; "
                         "use 'llama3', 'linear' or none")
    factor, context = scaling['factor'], scaling['original_max_position_embeddings']
    low, high = scaling['low_freq_factor'], scaling['high_freq_factor']
    wavelength = 2 * math.pi / inv_freq
    # 0 at the slow end, 1 at the fast end, linear in context / wavelength between
    smooth = ((context / wavelength - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_table(head_dim, max_seq_len, theta, scaling=None):
    # the rotation angle of pair i at position t is t * inv_freq[i]
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    # (T, hs): the "rotate half" layout of HF Llama
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x: (B, nh, T, hs). Pairs are (x[i], x[i + hs/2]), not adjacent elements,
    # as in HF Llama.
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def new_block(cfg):
    """A block; packed (inference, LoRA), frozen as soon as it is made, so that the fp32
    weights of the whole model are never there at once (low-rank corrections, made on
    the whole model, are the exception)."""
    if not cfg.packed or cfg.lrc_rank:
        return Block(cfg)
    return freeze(convert_to_bitnet(Block(cfg), cfg.norm_eps, scales=cfg.weight_scale,
                                    input_norms=cfg.linear_norm))


def init_weights(m):
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class Transformer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.grad_ckpt = False  # activation checkpointing (checkpoint_activations)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(new_block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer('cos', cos, persistent=False)
        self.register_buffer('sin', sin, persistent=False)
        self.apply(init_weights)
        for name, p in self.named_parameters():
            if name.endswith(('o_proj.weight', 'down_proj.weight')):
                # GPT-2's scaled init: shrink each residual branch's last layer (each adds variance)
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.bitnet:
            self.to_bitnet()
        if cfg.lrc_rank:
            add_lrc(self.layers, cfg.lrc_rank)
        if cfg.packed:
            freeze(self.layers)

    def to_bitnet(self, calib=(), linear_norm=False, weight_scale=None):
        """Swap every attention/MLP linear for a ternary BitLinear and insert SubLN (and,
        with linear_norm, an RMSNorm before every BitLinear): gain 1, or, given a few
        batches of token ids `calib` (a pretrained model), gains calibrated on them.
        weight_scale: 'matrix', 'row' or 'block' (None: the config's)."""
        cfg = dataclasses.replace(self.config, bitnet=True, subln=True,  # checks weight_scale
                                  weight_scale=weight_scale or self.config.weight_scale,
                                  linear_norm=self.config.linear_norm or linear_norm)
        convert_to_bitnet(self.layers, cfg.norm_eps, scales=cfg.weight_scale,
                          input_norms=cfg.linear_norm)
        self.config = cfg
        if calib:
            calibrate_subln(self, calib)
        return self

    @torch.no_grad()
    def upcycle(self, n_experts, top_k=2, norm_topk_prob=True, n_shared_experts=0,
                moe_intermediate_size=0):
        """Sparse upcycling (moe.py): every MLP becomes n_experts copies of itself behind
        a new router; with norm_topk_prob the model computes what it did."""
        cfg = self.config
        if n_shared_experts or moe_intermediate_size not in (0, cfg.intermediate_size):
            raise ValueError("upcycled experts are copies of the MLP: no shared expert, "
                             "no other size")
        if cfg.n_experts:
            raise ValueError("the model is a mixture of experts already")
        self.config = dataclasses.replace(cfg, n_experts=n_experts, top_k=top_k,  # checked
                                          norm_topk_prob=norm_topk_prob,
                                          moe_intermediate_size=cfg.intermediate_size)
        for block in self.layers:
            block.mlp = upcycle(block.mlp, self.config).to(self.embed_tokens.weight)
        return self

    def add_lrc(self, rank):
        """Give every BitLinear a low-rank fp correction, initialised from its current
        weights."""
        add_lrc(self.layers, rank)
        self.config = dataclasses.replace(self.config, lrc_rank=rank)
        return self

    def freeze(self):
        """Inference only: keep just the 2-bit weights and gamma of every BitLinear."""
        if not self.config.bitnet:
            raise ValueError("only a ternary model can be frozen; "
                             "call to_bitnet(), train it first")
        freeze(self.layers)
        self.config = dataclasses.replace(self.config, packed=True)
        return self

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def forward(self, idx, cache=None, pos=0, causal=True, feats=None, valid=None, keep=None):
        """Logits (B, T, vocab), or (N, vocab) at the N positions `keep` (B, T) marks: the
        head is a small model's widest layer: training asks only where a loss reads them.
        Distillation asks for more through `feats`, a dict filled in place: feats['hidden']
        (a list) gets every block's output, feats['qkv'] (a list) gets the q, k and v
        projections of block feats['qkv_layer'], feats['router'] (a list) gets every MoE
        layer's router logits (B * T, n_experts). feats['inputs'] (a list), when given, is
        each block's input in place of the previous block's output: teacher forcing, for
        block-wise reconstruction. `valid` (B, pos + T), True at real tokens, keeps the
        padding of left-padded rows out of every causal attention."""
        B, T = idx.shape
        if pos + T > self.config.max_seq_len:
            raise ValueError(f"{pos + T} tokens exceed "
                             f"max_seq_len={self.config.max_seq_len}")
        x = self.embed_tokens(idx)  # (B, T, C)
        cos, sin = self.cos[pos:pos + T].to(x.dtype), self.sin[pos:pos + T].to(x.dtype)
        feats = {} if feats is None else feats
        if not causal and self.config.sliding_window:
            raise ValueError("bidirectional attention (causal=False) with a sliding "
                             "window is not supported")
        mask = attention_mask(valid, pos, T, self.config.sliding_window, idx.device)
        caches = [None] * len(self.layers) if cache is None else cache
        for i, (block, layer_cache) in enumerate(zip(self.layers, caches)):
            if 'inputs' in feats:  # teacher forcing: the teacher's input to this block
                x = feats['inputs'][i]
            qkv = feats['qkv'] if i == feats.get('qkv_layer') else None
            router = [] if 'router' in feats else None  # a new list: FSDP rebuilds arguments
            x = self.run_block(block, x, cos, sin, layer_cache, pos, causal, qkv, mask, router)
            if 'hidden' in feats:
                feats['hidden'].append(x)
            if router:
                feats['router'] += router
        x = x if keep is None else x[keep]  # (N, C): only where a loss reads the logits
        return self.lm_head(self.norm(x))

    def run_block(self, block, *args):
        """block(*args); in training with checkpoint_activations, keeping only its
        inputs (backward recomputes the rest)."""
        if self.grad_ckpt and self.training:
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def checkpoint_activations(self, on=True):
        """Keep only each block's input in training; backward recomputes the rest (less
        memory, about a third more compute)."""
        self.grad_ckpt = on
        return self

    def flops_per_token(self, T):
        # 6 flops per parameter a token uses (forward + backward), plus attention's QK^T
        # and AV; a token uses top_k of an MoE's n_experts experts
        cfg = self.config
        idle = sum(p.numel() for n, p in self.named_parameters() if '.experts.' in n)
        idle *= 1 - cfg.top_k / cfg.n_experts if cfg.n_experts else 0
        return 6 * (self.num_params() - idle) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32):
        """Load a Hugging Face checkpoint directory of any family (hf_layout.py reads it;
        ternary online: latent weights; offline: packed, loaded frozen). hub.resolve_model
        fetches a hub id into a directory."""
        model = cls(ModelConfig(**hf_layout.read_config(path)))
        names = model.state_dict().keys()
        model.load_state_dict(hf_layout.read_weights(path, model.config, dtype, names),
                              strict=False)
        return model.to(dtype)

    def save_pretrained(self, path, state_dict=None):
        """Write config.json + model.safetensors that transformers opens as the family's
        class, or as BitNetForCausalLM for a ternary Llama (hf_layout.py)."""
        dtype = next(self.parameters()).dtype
        hf_layout.write(path, state_dict or self.state_dict(), self.config, dtype)
