"""
A Llama-family decoder, written out by hand so that every line can be read.

The architecture is the one shared by Llama 2/3, SmolLM2 and (with two extra norms and
ternary linears) BitNet b1.58 2B4T:

    x = embed(idx)
    for each block:
        x = x + o_proj(sub_norm(attention(rope(q), rope(k), v)))     q, k, v from norm(x)
        x = x + down_proj(sub_norm(act(gate_proj(h)) * up_proj(h)))  h = norm(x)
    logits = lm_head(norm(x))

- RMSNorm instead of LayerNorm, rotary position embeddings (RoPE, Su et al. 2021),
  grouped-query attention (GQA, Ainslie et al. 2023) through PyTorch's fused SDPA kernel,
  and a gated MLP with SiLU (Llama) or ReLU^2 (BitNet b1.58 2B4T).
- SubLN: the two `*_sub_norm` RMSNorms are Identity in a plain Llama. BitNet inserts them
  before the output projections so that the activations entering the ternary o_proj and
  down_proj are well scaled (Wang et al. 2023; see bitlinear.py).
- Module names are the Hugging Face ones (`q_proj`, `input_layernorm`, ...), so a
  checkpoint's tensors map onto ours by adding a `model.` prefix, and `save_pretrained`
  writes a directory that transformers opens as `LlamaForCausalLM` (fp) or
  `BitNetForCausalLM` (ternary: latent weights quantized online, or, after `freeze()`, the
  packed 2-bit weights of the offline format, which inference runs with kernels.py).
- `save_gguf` writes the same model as a GGUF file that llama.cpp runs: a ternary model in
  its `bitnet` architecture, the codes in llama.cpp's own ternary blocks (kernels.py).
"""
import functools
import json
import math
import os
import struct
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from bitlinear import SubLN, add_lrc, calibrate_subln, convert_to_bitnet, freeze, unpack_hf
from bitlinear import PackedBitLinear, weight_quant
from kernels import pack_f16, pack_int8, pack_q8_0, pack_tq1_0, pack_tq2_0, ternary_linear


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
    attention_bias: bool = False
    subln: bool = False          # the two extra RMSNorms of BitNet (always on when bitnet)
    bitnet: bool = False         # attention/MLP linears are ternary BitLinear
    lrc_rank: int = 0            # rank of the low-rank correction on each BitLinear (0: none)
    packed: bool = False         # BitLinears frozen to 2-bit PackedBitLinears (inference only)
    bos_token_id: int = None     # the tokenizer's; written to config.json even when None, since
    eos_token_id: int = None     # transformers would otherwise assume its own (eos 2, a byte here)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is no multiple of n_kv_head {self.n_kv_head}")
        if self.act not in ('silu', 'relu2'):
            raise ValueError(f"act={self.act!r} is not supported; use 'silu' or 'relu2'")


class Attention(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        C, bias = cfg.n_embd, cfg.attention_bias
        self.q_proj = nn.Linear(C, cfg.n_head * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(C, cfg.n_kv_head * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(C, cfg.n_kv_head * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, C, bias=bias)
        self.attn_sub_norm = SubLN(C, eps=cfg.norm_eps) if cfg.subln else nn.Identity()
        self.fused = None

    def forward(self, x, cos, sin, cache=None, pos=0, causal=True, qkv=None):
        B, T, _ = x.shape
        # (B, T, nh*hs), (B, T, nkv*hs) x2; in one call once fused (Transformer.fuse)
        q, k, v = self.fused(x) if self.fused else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if qkv is not None:  # hand the projections' outputs to attention-relation distillation
            qkv += [q, k, v]
        # (B, T, nh*hs) -> (B, nh, T, hs); K and V have fewer (shared) heads under GQA
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write this step's K/V, then attend over everything so far
            cache[0][:, :, pos:pos + T], cache[1][:, :, pos:pos + T] = k, v
            k, v = cache[0][:, :, :pos + T], cache[1][:, :, :pos + T]
        # a single new token may look at the whole cache, so only a multi-token step is causal;
        # causal=False is the bidirectional attention of masked diffusion
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1,
                                           enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.o_proj(self.attn_sub_norm(y))


class MLP(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        C, H = cfg.n_embd, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)
        self.ffn_sub_norm = SubLN(H, eps=cfg.norm_eps) if cfg.subln else nn.Identity()
        self.act = F.silu if cfg.act == 'silu' else lambda g: F.relu(g).square()
        self.fused = None

    def forward(self, x):
        g, u = self.fused(x) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.ffn_sub_norm(self.act(g) * u))


class Block(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, pos=0, causal=True, qkv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, pos, causal, qkv)
        return x + self.mlp(self.post_attention_layernorm(x))


def rope_table(head_dim, max_seq_len, theta):
    # the rotation angle of pair i at position t is t * theta^(-2i/d), in fp32 as in Llama
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs): the "rotate half" layout of HF Llama
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x: (B, nh, T, hs). Pairs are (x[i], x[i + hs/2]), not adjacent elements, as in HF Llama.
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Transformer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.grad_ckpt = False  # activation checkpointing, set by the trainer
        self.head8 = None  # the int8 head of fuse()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        # packed (inference, LoRA): frozen block by block, its fp32 weights never all there at once
        pack = cfg.packed and not cfg.lrc_rank  # (low-rank corrections are made on the whole model)
        block = lambda: freeze(convert_to_bitnet(Block(cfg), cfg.norm_eps)) if pack else Block(cfg)
        self.layers = nn.ModuleList(block() for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer('cos', cos, persistent=False)
        self.register_buffer('sin', sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(('o_proj.weight', 'down_proj.weight')):
                # GPT-2's scaled init: each residual branch adds variance, so shrink the last layer
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.bitnet:
            self.to_bitnet()
        if cfg.lrc_rank:
            add_lrc(self.layers, cfg.lrc_rank)
        if cfg.packed:
            freeze(self.layers)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def to_bitnet(self, calib=()):
        """Swap every attention/MLP linear for a ternary BitLinear and insert SubLN: gain 1, or,
        given a few batches of token ids `calib` (a pretrained model), gains calibrated on them."""
        convert_to_bitnet(self.layers, eps=self.config.norm_eps)
        self.config.bitnet = self.config.subln = True
        if calib:
            calibrate_subln(self, calib)
        return self

    def add_lrc(self, rank):
        """Give every BitLinear a low-rank fp correction, initialised from its current weights."""
        add_lrc(self.layers, rank)
        self.config.lrc_rank = rank
        return self

    def freeze(self):
        """Inference only: keep just the 2-bit weights and gamma of every BitLinear."""
        if not self.config.bitnet:
            raise ValueError("only a ternary model can be frozen; call to_bitnet(), train it first")
        freeze(self.layers)
        self.config.packed = True
        return self

    @torch.no_grad()
    def fuse(self):
        """Faster decode, after freeze(). q/k/v (and gate/up) read one input, so each group becomes
        one packed matrix: one activation quantization and one call, every row keeping its gamma
        (the same numbers). The fp head, most of the bytes a small model reads per token, gets int8
        rows (kernels.pack_int8, 4x fewer bytes; held-out cost in the README). Checkpoints do not
        change: fused matrices are views of the same bytes, the int8 head a copy."""
        groups = [(b.self_attn, ('q_proj', 'k_proj', 'v_proj')) for b in self.layers]
        for mod, names in groups + [(b.mlp, ('gate_proj', 'up_proj')) for b in self.layers]:
            ps = [getattr(mod, n) for n in names]
            if all(type(p) is PackedBitLinear and p.bias is None and p.lrc_u is None for p in ps):
                w, rows = torch.cat([p.weight for p in ps]), [p.out_features for p in ps]
                g = torch.cat([p.weight_scale.expand(n) for p, n in zip(ps, rows)])
                mod.fused = lambda x, w=w, g=g, rows=rows: ternary_linear(x, w, g).split(rows, -1)
                for p, view in zip(ps, w.split(rows)):
                    p.weight = view
        w8, scale = pack_int8(self.lm_head.weight)
        self.head8 = functools.partial(ternary_linear, w=w8, gamma=scale)
        return self

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def forward(self, idx, cache=None, pos=0, causal=True, feats=None):
        """Logits (B, T, vocab), always. Distillation asks for more through `feats`, a dict filled
        in place: feats['hidden'] (a list) gets every block's output, feats['qkv'] (a list) gets
        the q, k and v projections of block feats['qkv_layer']."""
        B, T = idx.shape
        if pos + T > self.config.max_seq_len:
            raise ValueError(f"{pos + T} tokens exceed max_seq_len={self.config.max_seq_len}")
        x = self.embed_tokens(idx)  # (B, T, C)
        cos, sin = self.cos[pos:pos + T].to(x.dtype), self.sin[pos:pos + T].to(x.dtype)
        feats = {} if feats is None else feats
        for i, block in enumerate(self.layers):
            qkv = feats['qkv'] if i == feats.get('qkv_layer') else None
            args = (x, cos, sin, None if cache is None else cache[i], pos, causal, qkv)
            if self.grad_ckpt and self.training:  # keep block inputs; backward recomputes the rest
                x = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)
            if 'hidden' in feats:
                feats['hidden'].append(x)
        return (self.head8 or self.lm_head)(self.norm(x))  # (B, T, vocab)

    def flops_per_token(self, T):
        # 6 flops per parameter per token (forward + backward) plus attention's QK^T and AV
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, eos_id=None, vocab=None):
        """Sample continuations of idx (B, T) with a KV cache: the prompt once, then one position
        per new token. `vocab` leaves out an embedding's padding rows beyond the tokenizer's."""
        cfg, (B, T) = self.config, idx.shape
        p = next(self.parameters())
        shape = (2, B, cfg.n_kv_head, T + max_new_tokens, cfg.head_dim)  # K and V
        cache = [torch.empty(shape, device=p.device, dtype=p.dtype) for _ in range(cfg.n_layer)]
        logits, pos = self(idx, cache, 0), 0
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :vocab].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('inf')
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx, pos = torch.cat((idx, nxt), dim=1), idx.size(1)
            if eos_id is not None and (nxt == eos_id).all():
                break
            logits = self(nxt, cache, pos)
        return idx

    # ---------------------------------------------------------------- Hugging Face format

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32):
        """Load a Hugging Face Llama or BitNet checkpoint directory (online: latent weights;
        offline: packed, loaded frozen): config.json plus model.safetensors, or shards listed in
        model.safetensors.index.json. (data.resolve_model fetches a hub id into a directory.)"""
        if not os.path.isfile(os.path.join(path, 'config.json')):
            raise FileNotFoundError(f"{path!r} is not a checkpoint directory (no config.json)")
        with open(os.path.join(path, 'config.json')) as f:
            hf = json.load(f)
        model = cls(config_from_hf(hf))
        index = os.path.join(path, 'model.safetensors.index.json')
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)['weight_map'].values()))
        else:
            files = ['model.safetensors']
        sd = {}
        for name in files:
            file = os.path.join(path, name)
            try:
                sd.update(load_file(file))
            except (OSError, SafetensorError) as e:
                raise ValueError(f"cannot read {file} ({e}); download or save it again") from None
        sd = {k.removeprefix('model.'): v.to(dtype) if v.is_floating_point() else v  # packed: uint8
              for k, v in sd.items() if not k.endswith('rotary_emb.inv_freq')}
        if (hf.get('quantization_config') or {}).get('linear_class') == 'bitlinear':
            for k in [k for k in sd if k.endswith('weight_scale')]:  # the old class: 1/gamma ...
                bias = k.removesuffix('weight_scale') + 'bias'
                if bias in sd:  # ... and adds the bias unscaled; ours is stored as bias / gamma
                    sd[bias] = sd[bias] * sd[k]
                sd[k] = 1 / sd[k]
        if tied := model.config.tie_embeddings:
            sd.pop('lm_head.weight', None)
        own = {k for k in model.state_dict() if not (tied and k == 'lm_head.weight')}
        missing, unexpected = own - sd.keys(), sd.keys() - own
        if missing or unexpected:
            raise ValueError(f"checkpoint {path!r} does not match its config.json: "
                             f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        model.load_state_dict(sd, strict=False)
        return model.to(dtype)

    def save_pretrained(self, path, state_dict=None):
        """Write config.json + model.safetensors that transformers loads as LlamaForCausalLM,
        or as BitNetForCausalLM for a ternary model (latent weights quantized online; packed
        2-bit weights, the offline format, once frozen)."""
        os.makedirs(path, exist_ok=True)
        sd = {('' if k.startswith('lm_head') else 'model.') + k: v.detach().contiguous()
              for k, v in (state_dict or self.state_dict()).items()}
        if self.config.tie_embeddings:
            sd.pop('lm_head.weight')  # safetensors stores a tensor once; HF re-ties on load
        save_file(sd, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
        with open(os.path.join(path, 'config.json'), 'w') as f:
            json.dump(config_to_hf(self.config, next(self.parameters()).dtype), f, indent=2)


    # ---------------------------------------------------------------- GGUF for llama.cpp

    @torch.no_grad()
    def save_gguf(self, path, vocab, ternary='tq2_0', dtype=torch.float32):
        """Write a GGUF file that llama.cpp runs: a ternary model in its `bitnet` architecture (the
        two sub-norms, the head tied to the embedding), each ternary matrix exactly, W_q with d =
        gamma in fp16, as TQ2_0 or TQ1_0 (Q8_0 or F16 for rows whose length is not a multiple of
        256; see kernels.py), or all Q8_0 or F16; an fp model in its `llama` architecture. The
        embedding (and an untied head) in `dtype` (fp32 or fp16), norms in fp32. `vocab`:
        data.gguf_vocab's keys."""
        cfg, arch = self.config, 'bitnet' if self.config.bitnet else 'llama'
        b = cfg.bitnet
        lacks = [what for what, bad in (
            ('low-rank corrections', cfg.lrc_rank), ('ReLU^2 (it uses SiLU)', cfg.act != 'silu'),
            ('attention biases', b and cfg.attention_bias), ('SubLN', cfg.subln and not b),
            ('an untied head', b and not cfg.tie_embeddings),
            ('head_dim * n_head != n_embd', b and cfg.head_dim * cfg.n_head != cfg.n_embd)) if bad]
        if lacks or ternary not in GGUF_TERNARY or dtype not in (torch.float32, torch.float16):
            raise ValueError(f"no GGUF export: llama.cpp's {arch} model has no {', '.join(lacks)}"
                             if lacks else f"ternary type {ternary!r} or dtype {dtype} unknown; use"
                             f" {'/'.join(GGUF_TERNARY)} and torch.float32/float16")
        tensors = []  # (GGUF name, ggml type, torch shape, bytes)
        for k, v in self.state_dict().items():
            if k.endswith('weight_scale') or (k == 'lm_head.weight' and cfg.tie_embeddings):
                continue
            parts = k.split('.')
            blk = f'blk.{parts[1]}.' if parts[0] == 'layers' else ''
            name = blk + GGUF_NAMES[parts[-2]] + '.' + parts[-1]
            if cfg.bitnet and k.endswith('proj.weight'):
                m = self.get_submodule(k.removesuffix('.weight'))
                w_q, gamma = (unpack_hf(v, m.out_features), m.weight_scale) if cfg.packed else weight_quant(v)
                # the asked type if the row length fits its blocks, else the next one that does
                fits = [GGUF_TERNARY[t] for t in (ternary, 'q8_0', 'f16')]
                pack, kind, _ = next(f for f in fits if w_q.shape[1] % f[2] == 0)
                tensors.append((name, kind, w_q.shape, pack(w_q, gamma).numpy().tobytes()))
                continue
            if arch == 'llama' and parts[-2] in ('q_proj', 'k_proj'):
                # llama.cpp's `llama` RoPE rotates adjacent pairs (x0, x1), ours (and HF's) the two
                # halves of a head (x0, x_{d/2}): reorder each head's rows to match
                heads = cfg.n_head if parts[-2] == 'q_proj' else cfg.n_kv_head
                v = v.reshape(heads, 2, -1, *v.shape[1:]).transpose(1, 2).reshape(v.shape)
            kind = 1 if v.dim() == 2 and dtype == torch.float16 else 0  # ggml's F16, F32
            tensors.append((name, kind, v.shape, (v.half() if kind else v.float()).numpy().tobytes()))
        hs, att = cfg.head_dim, 'attention.'
        meta = {'vocab_size': cfg.vocab_size, 'context_length': cfg.max_seq_len,
                'embedding_length': cfg.n_embd, 'block_count': cfg.n_layer,
                'feed_forward_length': cfg.intermediate_size, 'rope.dimension_count': hs,
                'rope.freq_base': float(cfg.rope_theta), att + 'key_length': hs,
                att + 'value_length': hs,
                att + 'head_count': cfg.n_head, att + 'head_count_kv': cfg.n_kv_head,
                att + 'layer_norm_rms_epsilon': float(cfg.norm_eps)}
        kv = {'general.architecture': arch, 'general.file_type': GGUF_FILE_TYPE[ternary if b else dtype],
              **{f'{arch}.{k}': v for k, v in meta.items()}, **vocab}
        for which in ('bos', 'eos'):
            if getattr(cfg, which + '_token_id') is not None:
                kv[f'tokenizer.ggml.{which}_token_id'] = getattr(cfg, which + '_token_id')
        write_gguf(path, kv, tensors)


GGUF_NAMES = dict(embed_tokens='token_embd', norm='output_norm', lm_head='output',
                  input_layernorm='attn_norm', q_proj='attn_q', k_proj='attn_k', v_proj='attn_v',
                  o_proj='attn_output', attn_sub_norm='attn_sub_norm',
                  post_attention_layernorm='ffn_norm', gate_proj='ffn_gate', up_proj='ffn_up',
                  down_proj='ffn_down', ffn_sub_norm='ffn_sub_norm')
# packer, ggml type, the multiple a row's length must be; all exact (F16 fits any row, at 16 bits)
GGUF_TERNARY = {'tq2_0': (pack_tq2_0, 35, 256), 'tq1_0': (pack_tq1_0, 34, 256),
                'q8_0': (pack_q8_0, 8, 32), 'f16': (pack_f16, 1, 1)}
# LLAMA_FTYPE_*
GGUF_FILE_TYPE = {torch.float32: 0, torch.float16: 1, 'f16': 1, 'q8_0': 7, 'tq1_0': 36, 'tq2_0': 37}


def write_gguf(path, kv, tensors):
    """GGUF v3 as llama.cpp's ggml/src/gguf.cpp reads it: magic, version, counts; the key-values,
    each typed (ints as uint32, floats as float32, lists of strings or int32); each tensor's name,
    dims innermost first, ggml type and offset; then the data, each tensor aligned to 32 bytes.
    Written under a temporary name and renamed, so a failed export leaves no half file."""
    def string(s):
        return struct.pack('<Q', len(s.encode())) + s.encode()

    def value(v):  # -> GGUF type id, bytes
        if isinstance(v, (bool, int, float, str)):
            kind, fmt = {bool: (7, '?'), int: (4, '<I'), float: (6, '<f'), str: (8, '')}[type(v)]
            return kind, string(v) if kind == 8 else struct.pack(fmt, v)
        kind = 5 if v and isinstance(v[0], int) else 8
        items = b''.join(string(x) for x in v) if kind == 8 else struct.pack(f'<{len(v)}i', *v)
        return 9, struct.pack('<IQ', kind, len(v)) + items

    head, offset = [struct.pack('<IIQQ', 0x46554747, 3, len(tensors), len(kv))], 0
    for k, v in kv.items():
        kind, data = value(v)
        head.append(string(k) + struct.pack('<I', kind) + data)
    for name, kind, shape, data in tensors:
        head.append(string(name) + struct.pack(f'<I{len(shape)}QIQ', len(shape), *reversed(shape), kind, offset))
        offset += -(-len(data) // 32) * 32
    head = b''.join(head)
    with open(path + '.tmp', 'wb') as f:
        f.write(head + bytes(-len(head) % 32))
        for *_, data in tensors:
            f.write(data + bytes(-len(data) % 32))
    os.replace(path + '.tmp', path)

HF_KEYS = dict(vocab_size='vocab_size', n_layer='num_hidden_layers', n_embd='hidden_size',
               n_head='num_attention_heads', n_kv_head='num_key_value_heads', head_dim='head_dim',
               intermediate_size='intermediate_size', norm_eps='rms_norm_eps',
               max_seq_len='max_position_embeddings', tie_embeddings='tie_word_embeddings',
               act='hidden_act', attention_bias='attention_bias', lrc_rank='lrc_rank',
               bos_token_id='bos_token_id', eos_token_id='eos_token_id')


def config_from_hf(hf):
    kind = hf.get('model_type')
    if kind not in ('llama', 'bitnet', 'bitnet_lrc'):
        raise ValueError(f"model_type {kind!r} is not supported; use a llama or bitnet checkpoint")
    kind = 'bitnet' if kind == 'bitnet_lrc' else kind
    rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
    if (scaling := rope.get('rope_type', rope.get('type', 'default'))) != 'default':
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    if hf.get('mlp_bias'):
        raise ValueError("mlp_bias=true is not supported; Llama-family MLPs here have no bias")
    quant = hf.get('quantization_config') or {}
    mode, linear = quant.get('quantization_mode', 'online'), quant.get('linear_class', 'autobitlinear')
    if kind == 'bitnet' and (mode not in ('online', 'offline') or linear not in ('autobitlinear', 'bitlinear')
                             or quant.get('use_rms_norm')):
        raise ValueError(f"BitNet quantization_config {quant} is not supported; use linear_class 'autobitlinear' "
                         "or 'bitlinear', quantization_mode 'online' or 'offline', no use_rms_norm")
    kw = {ours: hf[theirs] for ours, theirs in HF_KEYS.items() if hf.get(theirs) is not None}
    kw['rope_theta'] = float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))
    kw.setdefault('tie_embeddings', False)  # the Llama default
    kw['bitnet'] = kw['subln'] = kind == 'bitnet'
    kw['packed'] = kind == 'bitnet' and (mode == 'offline' or linear == 'bitlinear')  # always packed
    return ModelConfig(**kw)


def config_to_hf(cfg, dtype):
    hf = {theirs: getattr(cfg, ours) for ours, theirs in HF_KEYS.items()}
    hf.update(rope_theta=cfg.rope_theta, dtype=str(dtype).removeprefix('torch.'), mlp_bias=False,
              rope_parameters={'rope_type': 'default', 'rope_theta': cfg.rope_theta},
              model_type='llama', architectures=['LlamaForCausalLM'])
    if cfg.bitnet:
        if cfg.head_dim * cfg.n_head != cfg.n_embd:
            raise ValueError("BitNetForCausalLM needs head_dim * n_head == n_embd")
        hf.update(model_type='bitnet', architectures=['BitNetForCausalLM'],
                  quantization_config={'quant_method': 'bitnet', 'linear_class': 'autobitlinear',
                                       'quantization_mode': 'offline' if cfg.packed else 'online'})
        if cfg.lrc_rank:  # transformers has no low-rank corrections and would drop them silently:
            hf.update(model_type='bitnet_lrc', architectures=['BitNetLRCForCausalLM'])  # it refuses
    elif cfg.subln:
        raise ValueError("an fp model with SubLN has no transformers class; convert it to BitNet")
    return hf
