"""
GGUF for llama.cpp: a model's state dict as one file that llama.cpp runs. (Not named
gguf.py: that would shadow the `gguf` package of llama.cpp, which transformers' GGUF
loader imports.)

A GGUF file is a header of typed key-values (the architecture's hyperparameters, the
tokenizer), a table of tensors (name, shape, ggml type, offset), then the tensors'
bytes, each aligned to 32 (llama.cpp's ggml/src/gguf.cpp reads it). A ternary model goes
in llama.cpp's `bitnet` architecture, an fp one in its family's (`llama` for Llama and
Mistral, `qwen2`, `qwen3`).

Ternary matrices are stored exactly. GGUF stores a matrix row by row in blocks
(ggml-quants.c in llama.cpp; TQ1_0 and TQ2_0 by compilade, 2024): TQ2_0 and TQ1_0 hold
256 ternary codes and one fp16 scale d each, so d = gamma makes them exact; Q4_0 holds
32 4-bit codes q and d, read as (q - 8) * d, exact for q = W_q + 8 (4.5 bits a weight),
the fallback for rows whose length is not a multiple of 256 (SmolLM2's 576); Q8_0 (32
int8 codes and d) is exact too, at 8.5 bits; F16 (no blocks) for rows not a multiple of
32, where +-gamma in fp16 is exact as well. The embedding (the tied head) may go in Q8_0,
as llama.cpp quantizes it: the one rounded tensor, its cost in docs/llama_cpp.md.

The tokenizer goes in as llama.cpp's 'gpt2' BPE keys (`gguf_vocab`), and LoRA adapters
on a ternary base as llama.cpp's separate adapter file (`save_lora_gguf`). This file
works from a state dict and a config: it needs bitlinear.py (the quantizer), model.py
(RoPE's frequencies) and tokenizer.py beside it.
"""
import math
import os
import struct

import torch

from bitlinear import dequantize, unpack_hf, weight_quant
from model import rope_frequencies
from tokenizer import (DIGITS_PATTERN, GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN,
                       byte_alphabet)

# ---------------------------------------------------------- llama.cpp's block layouts


def with_d(blocks, gamma, d_first=False):
    """(N, nb, bytes) uint8 blocks -> (N, nb * (bytes + 2)): fp16 gamma after (or
    before) each. gamma, as every packer below takes it: (1, 1), (N, 1) per row, or
    (N, K/256) per row and 256 columns."""
    N, nb = blocks.shape[:2]
    d = gamma.half().repeat_interleave(nb // gamma.shape[1], dim=1)  # one per block
    d = d.expand(N, nb).unsqueeze(-1).contiguous().view(torch.uint8)
    return torch.cat([d, blocks] if d_first else [blocks, d], -1).flatten(1)


def pack_tq2_0(w_q, gamma):
    """(N, K) codes, K % 256 == 0 -> TQ2_0 rows: in each 128 codes, byte m holds codes
    m, m+32, m+64, m+96 as 2-bit q + 1 (lowest bits first), then d."""
    N, K = w_q.shape
    c = (w_q.to(torch.int8) + 1).to(torch.uint8).view(N, K // 128, 4, 32)
    qs = c[:, :, 0] | c[:, :, 1] << 2 | c[:, :, 2] << 4 | c[:, :, 3] << 6  # (N, K/128, 32)
    return with_d(qs.view(N, K // 256, 64), gamma)


def trits(c):
    """(..., n, m) codes in {0, 1, 2} -> (..., m) bytes: the n base-3 digits, the first
    most significant, as the fraction v / 3^5 scaled to 256 and rounded up,
    so that llama.cpp reads digit i back as ((byte * 3^i) mod 256) * 3 >> 8
    with one multiply."""
    v = sum(c[..., i, :] * 3 ** (4 - i) for i in range(c.shape[-2]))
    return ((v * 256 + 242) // 243).to(torch.uint8)


def pack_tq1_0(w_q, gamma):
    """(N, K) codes, K % 256 == 0 -> TQ1_0 rows: 5 codes per byte (3^5 = 243 < 256). Of
    each 256, codes 0-159 go to 32 bytes (byte m: m, m+32, ..., m+128), 160-239 to 16
    bytes (stride 16), and the last 16 to 4 bytes at 4 per byte (stride 4), then d."""
    N, K = w_q.shape
    c = (w_q.to(torch.int32) + 1).view(N, K // 256, 256)
    first = trits(c[..., :160].unflatten(-1, (5, 32)))
    second = trits(c[..., 160:240].unflatten(-1, (5, 16)))
    high = trits(c[..., 240:].unflatten(-1, (4, 4)))
    return with_d(torch.cat([first, second, high], -1), gamma)


def pack_q4_0(w_q, gamma):
    """(N, K) codes, K % 32 == 0 -> Q4_0 rows: per 32 codes, d first, then 16 bytes, byte j
    holding code j in its low 4 bits and code j + 16 in its high ones, each as q + 8."""
    N, K = w_q.shape
    c = (w_q.to(torch.int8) + 8).to(torch.uint8).view(N, K // 32, 2, 16)
    return with_d(c[:, :, 0] | c[:, :, 1] << 4, gamma, d_first=True)


def pack_q8_0(w_q, gamma):
    """(N, K) codes, K % 32 == 0 -> Q8_0 rows: per 32 codes, d first, then 32 int8."""
    N, K = w_q.shape
    blocks = w_q.to(torch.int8).view(torch.uint8).view(N, K // 32, 32)
    return with_d(blocks, gamma, d_first=True)


def pack_f16(w_q, gamma):
    return dequantize(w_q.to(torch.float16), gamma.to(torch.float16)).view(torch.uint8)


def quantize_q8_0(w):
    """(N, K) fp weights, K % 32 == 0 -> Q8_0 rows, as llama.cpp quantizes them: per 32
    weights d = max|w| / 127 (stored in fp16) and q = round(w / d) (from the fp32 d)."""
    N, K = w.shape
    blocks = w.float().view(N, K // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = (blocks * torch.where(d > 0, 1 / d, 0)).round().to(torch.int8)
    d = d.half().view(torch.uint8).view(N, K // 32, 2)
    return torch.cat([d, q.view(torch.uint8)], -1).flatten(1)


# packer, ggml type, the multiple a row's length must be;
# all exact (F16 fits any row, at 16 bits)
TERNARY = {'tq2_0': (pack_tq2_0, 35, 256), 'tq1_0': (pack_tq1_0, 34, 256),
           'q4_0': (pack_q4_0, 2, 32), 'q8_0': (pack_q8_0, 8, 32), 'f16': (pack_f16, 1, 1)}
# LLAMA_FTYPE_* of the whole file
FILE_TYPE = {torch.float32: 0, torch.float16: 1,
             'f16': 1, 'q4_0': 2, 'q8_0': 7, 'tq1_0': 36, 'tq2_0': 37}
# the llama.cpp architecture of each family's fp model
ARCH = {'llama': 'llama', 'mistral': 'llama', 'qwen2': 'qwen2', 'qwen3': 'qwen3'}
# our (Hugging Face) module names -> llama.cpp's tensor names
NAMES = dict(embed_tokens='token_embd', norm='output_norm', lm_head='output',
             input_layernorm='attn_norm', q_proj='attn_q', k_proj='attn_k',
             v_proj='attn_v', o_proj='attn_output', attn_sub_norm='attn_sub_norm',
             post_attention_layernorm='ffn_norm', gate_proj='ffn_gate', up_proj='ffn_up',
             down_proj='ffn_down', ffn_sub_norm='ffn_sub_norm', q_norm='attn_q_norm',
             k_norm='attn_k_norm')

# ---------------------------------------------------------- the file


def write_gguf(path, kv, tensors):
    """GGUF v3: magic, version, counts; the key-values, each typed (ints as uint32,
    floats as float32, lists of strings or int32); each tensor's name, dims innermost
    first, ggml type and offset; then the data, each tensor aligned to 32 bytes.
    `tensors`: (name, ggml type, shape, bytes). Written under a temporary name and
    renamed, so a failed export leaves no half file."""
    def string(s):
        return struct.pack('<Q', len(s.encode())) + s.encode()

    def value(v):  # -> GGUF type id, bytes
        if isinstance(v, (bool, int, float, str)):
            types = {bool: (7, '?'), int: (4, '<I'), float: (6, '<f'), str: (8, '')}
            kind, fmt = types[type(v)]
            return kind, string(v) if kind == 8 else struct.pack(fmt, v)
        if v and isinstance(v[0], int):
            return 9, struct.pack('<IQ', 5, len(v)) + struct.pack(f'<{len(v)}i', *v)
        return 9, struct.pack('<IQ', 8, len(v)) + b''.join(string(x) for x in v)

    head = [struct.pack('<IIQQ', 0x46554747, 3, len(tensors), len(kv))]
    for k, v in kv.items():
        kind, data = value(v)
        head.append(string(k) + struct.pack('<I', kind) + data)
    offset = 0
    for name, kind, shape, data in tensors:
        dims = struct.pack(f'<I{len(shape)}Q', len(shape), *reversed(shape))
        head.append(string(name) + dims + struct.pack('<IQ', kind, offset))
        offset += -(-len(data) // 32) * 32
    head = b''.join(head)
    with open(path + '.tmp', 'wb') as f:
        f.write(head + bytes(-len(head) % 32))
        for *_, data in tensors:
            f.write(data + bytes(-len(data) % 32))
    os.replace(path + '.tmp', path)


def unsupported(cfg):
    """What llama.cpp's architecture for this model lacks
    (an empty list: it can be exported)."""
    b = cfg.bitnet
    lacks = {f'{cfg.family} layers': b and cfg.family != 'llama',
             'RoPE scaling': b and cfg.rope_scaling,
             'q/k/v biases without an o_proj bias': cfg.qkv_bias and ARCH[cfg.family] == 'llama',
             'low-rank corrections': cfg.lrc_rank,
             'an RMSNorm before every linear (linear_norm)': cfg.linear_norm,
             'a mixture of experts': cfg.n_experts,
             'ReLU^2 (it uses SiLU)': cfg.act != 'silu',
             'attention biases': b and cfg.attention_bias,
             'SubLN': cfg.subln and not b,
             'an untied head': b and not cfg.tie_embeddings,
             'head_dim * n_head != n_embd': b and cfg.head_dim * cfg.n_head != cfg.n_embd}
    return [what for what, bad in lacks.items() if bad]


@torch.no_grad()
def save_gguf(path, state_dict, cfg, vocab, ternary='tq2_0', dtype=torch.float32,
              embedding=None):
    """Write a model (its state dict and config, model.ModelConfig's fields) as GGUF: a
    ternary model in llama.cpp's `bitnet` architecture (the two sub-norms, the head tied
    to the embedding), each ternary matrix exactly, W_q with d = gamma in fp16, as
    `ternary` (TQ2_0 or TQ1_0; Q4_0, else F16, for rows whose length is not a multiple
    of 256), or all Q4_0, Q8_0 or F16; an fp model in its family's architecture (ARCH).
    The embedding (and an untied head) in `dtype` (fp32 or fp16) or in `embedding`
    ('q8_0'), norms in fp32; an fp model's matrices in `dtype` too, or in Q8_0 (dtype
    'q8_0'; the embedding then in fp32 unless `embedding` says). Latent weights are
    quantized here, packed ones (uint8, transformers' offline layout) unpacked.
    llama.cpp's `llama` has no sliding window: a Mistral's context is cut to its window,
    within which the two agree. `vocab`: gguf_vocab's keys."""
    arch = 'bitnet' if cfg.bitnet else ARCH[cfg.family]
    lacks = unsupported(cfg)
    if lacks:
        raise ValueError(f"no GGUF export: llama.cpp's {arch} model "
                         f"has no {', '.join(lacks)}")
    if ternary not in TERNARY or dtype not in (torch.float32, torch.float16, 'q8_0') \
            or embedding not in (None, 'q8_0'):
        raise ValueError(f"ternary type {ternary!r}, dtype {dtype} or embedding {embedding!r} "
                         f"unknown; use {'/'.join(TERNARY)}, torch.float32/float16 or 'q8_0', "
                         f"and None or 'q8_0'")
    hs = cfg.head_dim
    rows = dict(q_proj=cfg.n_head * hs, k_proj=cfg.n_kv_head * hs,
                v_proj=cfg.n_kv_head * hs, o_proj=cfg.n_embd,
                gate_proj=cfg.intermediate_size, up_proj=cfg.intermediate_size,
                down_proj=cfg.n_embd)
    tensors = []  # (GGUF name, ggml type, torch shape, bytes)
    for k, v in state_dict.items():
        if k.endswith('weight_scale'):
            continue
        if k == 'lm_head.weight' and cfg.tie_embeddings:
            continue
        parts = k.split('.')
        module = parts[-2]
        name = NAMES[module] + '.' + parts[-1]
        if parts[0] == 'layers':
            name = f'blk.{parts[1]}.' + name
        if cfg.bitnet and k.endswith('proj.weight'):
            if v.dtype == torch.uint8:  # packed: the 2-bit codes and their stored gamma
                w_q, gamma = unpack_hf(v, rows[module]), state_dict[k + '_scale']
            else:
                w_q, gamma = weight_quant(v, cfg.weight_scale)
            if gamma.dim() < 2:
                gamma = gamma.reshape(-1, 1)  # (1, 1), or (N, 1) per row
            # the asked type if the row length fits its blocks,
            # else the next one that does
            fits = [TERNARY[t] for t in (ternary, 'q4_0', 'f16')]
            pack, kind, _ = next(f for f in fits if w_q.shape[1] % f[2] == 0)
            tensors.append((name, kind, w_q.shape, pack(w_q, gamma).numpy().tobytes()))
            continue
        if arch == 'llama' and module in ('q_proj', 'k_proj'):
            # llama.cpp's `llama` RoPE rotates adjacent pairs (x0, x1), ours (and HF's)
            # the two halves of a head (x0, x_{d/2}): reorder each head's rows to match
            heads = cfg.n_head if module == 'q_proj' else cfg.n_kv_head
            v = v.reshape(heads, 2, -1, *v.shape[1:]).transpose(1, 2).reshape(v.shape)
        matrix = k.endswith('proj.weight') and dtype == 'q8_0'
        table = module in ('embed_tokens', 'lm_head') and embedding == 'q8_0'
        if (matrix or table) and v.shape[1] % 32 == 0:
            tensors.append((name, 8, v.shape, quantize_q8_0(v).numpy().tobytes()))
            continue
        half = v.dim() == 2 and dtype == torch.float16
        data = v.half() if half else v.float()
        tensors.append((name, 1 if half else 0, v.shape, data.numpy().tobytes()))  # F16, F32
    meta = {'vocab_size': cfg.vocab_size, 'context_length': cfg.max_seq_len,
            'embedding_length': cfg.n_embd, 'block_count': cfg.n_layer,
            'feed_forward_length': cfg.intermediate_size, 'rope.dimension_count': hs,
            'rope.freq_base': float(cfg.rope_theta),
            'attention.key_length': hs, 'attention.value_length': hs,
            'attention.head_count': cfg.n_head, 'attention.head_count_kv': cfg.n_kv_head,
            'attention.layer_norm_rms_epsilon': float(cfg.norm_eps)}
    if cfg.sliding_window:  # llama.cpp's llama has no window: no context beyond it
        meta['context_length'] = min(cfg.max_seq_len, cfg.sliding_window)
    scaling = cfg.rope_scaling or {}
    if scaling.get('rope_type') == 'linear':
        meta['rope.scaling.type'] = 'linear'
        meta['rope.scaling.factor'] = float(scaling['factor'])
    if scaling.get('rope_type') == 'llama3':
        # llama.cpp divides each pair's speed by its factor from this tensor
        plain = rope_frequencies(hs, cfg.rope_theta)
        factors = plain / rope_frequencies(hs, cfg.rope_theta, scaling)
        tensors.append(('rope_freqs.weight', 0, factors.shape, factors.numpy().tobytes()))
    kv = {'general.architecture': arch,
          'general.file_type': FILE_TYPE[ternary if cfg.bitnet else dtype]}
    kv.update({f'{arch}.{k}': v for k, v in meta.items()})
    kv.update(vocab)
    if cfg.bos_token_id is not None:
        kv['tokenizer.ggml.bos_token_id'] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        kv['tokenizer.ggml.eos_token_id'] = cfg.eos_token_id
    write_gguf(path, kv, tensors)


def save_lora_gguf(path, adapters, alpha, arch='bitnet'):
    """LoRA adapters as llama.cpp's adapter file (llama-cli -m BASE.gguf --lora FILE):
    each A (r, in) and B (out, r) in fp32, named after its matrix. `adapters`: a state
    dict of the model's blocks holding the adapters ('0.self_attn.q_proj.lora_A.weight',
    ...). llama.cpp adds (alpha / r) B A x, as lora.LoRALinear does."""
    tensors = []
    for k, v in adapters.items():
        if '.lora_' not in k:
            continue
        block, _, module, ab, _ = k.split('.')
        name = f'blk.{block}.{NAMES[module]}.weight.{ab.lower()}'
        tensors.append((name, 0, v.shape, v.float().numpy().tobytes()))
    kv = {'general.architecture': arch, 'general.type': 'adapter',
          'adapter.type': 'lora', 'adapter.lora.alpha': float(alpha)}
    write_gguf(path, kv, tensors)


# ---------------------------------------------------------- the vocabulary

# the names under which llama.cpp (src/llama-vocab.cpp) runs each pre-tokenizer regex
LLAMA_CPP_PRE = {GPT2_PATTERN: 'gpt-2', DIGITS_PATTERN: 'smollm', LLAMA3_PATTERN: 'llama-bpe',
                 QWEN2_PATTERN: 'qwen2'}


def gguf_vocab(enc, vocab_size):
    """The tokenizer as the GGUF keys of llama.cpp's 'gpt2' BPE: each token spelled in
    GPT-2's byte alphabet with its type (1 normal, 3 control: a special token, 5 unused:
    padding rows up to vocab_size), the merges in rank order, and the pre-tokenizer's
    name. tiktoken keeps ranks, not merges: the merge that makes a token is the last
    step of BPE on its bytes."""
    if enc._pat_str not in LLAMA_CPP_PRE:
        raise ValueError(f"tokenizer {enc.name!r}: "
                         f"llama.cpp has no pre-tokenizer for its regex; "
                         f"use a GPT-2, SmolLM2, Llama 3 or Qwen2 style tokenizer")
    glyph = byte_alphabet()
    special = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    pieces = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
    ranks = {p: i for i, p in enumerate(pieces) if i not in special}

    def spell(b):
        return ''.join(glyph[c] for c in b)
    types, tokens = [], []
    for i in range(vocab_size):
        if i >= enc.n_vocab:
            types.append(5)
            tokens.append(f'[PAD{i}]')
        elif i in special:
            types.append(3)
            tokens.append(pieces[i].decode())
        else:
            types.append(1)
            tokens.append(spell(pieces[i]))
    merges = []
    for token in ranks:  # in id order, which is rank order
        segs = [token[i:i + 1] for i in range(len(token))]
        while len(segs) > 2:  # merge the lowest-ranked pair, as tiktoken does
            pairs = [segs[j] + segs[j + 1] for j in range(len(segs) - 1)]
            pair_rank = [ranks.get(pair, math.inf) for pair in pairs]
            i = pair_rank.index(min(pair_rank))
            segs[i:i + 2] = [segs[i] + segs[i + 1]]
        if len(segs) == 2:
            merges.append(spell(segs[0]) + ' ' + spell(segs[1]))
    return {'tokenizer.ggml.model': 'gpt2',
            'tokenizer.ggml.pre': LLAMA_CPP_PRE[enc._pat_str],
            'tokenizer.ggml.tokens': tokens, 'tokenizer.ggml.token_type': types,
            'tokenizer.ggml.merges': merges, 'tokenizer.ggml.add_bos_token': False}
