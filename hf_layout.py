"""
The Hugging Face layout of a checkpoint directory, in and out: config.json's keys for each
family, and the weights' names (model.safetensors, or shards listed in
model.safetensors.index.json). model.Transformer.from_pretrained and save_pretrained call
this file; it knows nothing of the modules, only names, shapes and keys.

- A family is a transformers `model_type` whose decoder is Llama's with a few switches:
  Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (a norm on each head's q and k).
  Their mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral) are read and written by moe.py's
  keys; Mixtral's expert names are renamed on the way in and out.
- A ternary Llama is transformers' `BitNetForCausalLM` ("online": latent weights quantized
  as they are used; "offline": the packed 2-bit weights). A ternary layout transformers
  has no class for (another family, scales per row or block, low-rank corrections, ternary
  experts) is written under our own model_type, which transformers refuses rather than
  dropping what it cannot hold.
"""
import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moe import MOE_CLASSES, MOE_TYPES, moe_from_hf, moe_to_hf

# model_type: the transformers class, and the switches that model_type fixes
FAMILIES = {
    'llama': ('LlamaForCausalLM', dict(qkv_bias=False, qk_norm=False)),
    'mistral': ('MistralForCausalLM', dict(qkv_bias=False, qk_norm=False, attention_bias=False)),
    'qwen2': ('Qwen2ForCausalLM', dict(qkv_bias=True, qk_norm=False, attention_bias=False)),
    'qwen3': ('Qwen3ForCausalLM', dict(qkv_bias=False, qk_norm=True)),
}

# our ModelConfig's names: config.json's
HF_KEYS = dict(vocab_size='vocab_size', n_layer='num_hidden_layers',
               n_embd='hidden_size', n_head='num_attention_heads',
               n_kv_head='num_key_value_heads', head_dim='head_dim',
               intermediate_size='intermediate_size', norm_eps='rms_norm_eps',
               max_seq_len='max_position_embeddings',
               tie_embeddings='tie_word_embeddings', act='hidden_act',
               attention_bias='attention_bias', lrc_rank='lrc_rank',
               bos_token_id='bos_token_id', eos_token_id='eos_token_id')
# the keys of config.json that hold one number (a token id may be a list of them)
NUMBERS = ('vocab_size', 'num_hidden_layers', 'hidden_size', 'num_attention_heads',
           'num_key_value_heads', 'head_dim', 'intermediate_size', 'rms_norm_eps',
           'max_position_embeddings', 'lrc_rank')

# Mixtral's names for an MoE block's parts (ours are Qwen2-MoE's)
MIXTRAL_NAMES = {'.mlp.': '.block_sparse_moe.', '.gate_proj.': '.w1.',
                 '.up_proj.': '.w3.', '.down_proj.': '.w2.'}

# our ternary models of other families, which no transformers class opens (its BitNet
# has no q/k norm, no q/k/v-only bias, no sliding window; see config_to_hf)
OWN_TYPES = ('bitnet', 'bitnet_lrc', 'bitnet_moe', *(f'bitnet_{f}' for f in FAMILIES))


def renamed(sd, names, inbound=False):
    """A state dict with our names of an MoE block's parts replaced by another family's
    (`names`: ours -> theirs), or theirs by ours when `inbound`."""
    pairs = [(b, a) for a, b in names.items()] if inbound else list(names.items())
    out = {}
    for k, v in sd.items():
        if '.mlp.' in k or '.block_sparse_moe.' in k:
            for a, b in pairs:
                k = k.replace(a, b)
        out[k] = v
    return out


def config_from_hf(hf):
    """config.json (a dict) as the keyword arguments of a model.ModelConfig."""
    kind = hf.get('model_type')
    if kind not in (*FAMILIES, *MOE_CLASSES, *OWN_TYPES):
        raise ValueError(f"model_type {kind!r} is not supported; use a checkpoint of "
                         f"{', '.join([*FAMILIES, *MOE_CLASSES])} or bitnet")
    family = hf.get('family', 'llama') if kind in OWN_TYPES else kind
    # an MoE's family: its dense sibling's (our Qwen2-MoE of a Llama has no q/k/v bias;
    # Qwen's own, from before transformers wrote the key, always do)
    moe_family = {'mixtral': 'mistral', 'qwen3_moe': 'qwen3',
                  'qwen2_moe': 'qwen2' if hf.get('qkv_bias', True) else 'llama'}
    family = moe_family.get(family, family)
    moe = {}
    if kind in MOE_CLASSES or kind == 'bitnet_moe':
        moe = moe_from_hf(hf, MOE_TYPES[family])
    kind = 'bitnet' if kind.startswith('bitnet') else kind
    if hf.get('use_sliding_window'):
        raise ValueError("use_sliding_window=true (Qwen's windows on some layers) is not "
                         "supported; use a checkpoint with it false")
    rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
    if hf.get('mlp_bias'):
        raise ValueError("mlp_bias=true is not supported; "
                         "Llama-family MLPs here have no bias")
    quant = hf.get('quantization_config') or {}
    mode = quant.get('quantization_mode', 'online')
    linear = quant.get('linear_class', 'autobitlinear')
    if kind == 'bitnet' and (mode not in ('online', 'offline')
                             or linear not in ('autobitlinear', 'bitlinear')):
        raise ValueError(f"BitNet quantization_config {quant} is not supported; use "
                         "linear_class 'autobitlinear' or 'bitlinear', "
                         "quantization_mode 'online' or 'offline'")
    model_eps = hf.get('rms_norm_eps', 1e-5)  # ModelConfig's default
    if quant.get('use_rms_norm') and quant.get('rms_norm_eps', 1e-6) != model_eps:
        raise ValueError("use_rms_norm with rms_norm_eps apart from the model's is not "
                         "supported; set the two equal")
    kw = {ours: hf[theirs] for ours, theirs in HF_KEYS.items()
          if hf.get(theirs) is not None} | moe
    kw['rope_theta'] = float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))
    if (scaling := rope.get('rope_type', rope.get('type', 'default'))) != 'default':
        kept = {k: v for k, v in rope.items() if k not in ('rope_theta', 'type')}
        kw['rope_scaling'] = kept | {'rope_type': scaling}
    kw |= dict(FAMILIES[family][1], family=family)
    if family == 'mistral':
        kw['sliding_window'] = hf.get('sliding_window') or 0
    kw.setdefault('tie_embeddings', False)  # the Llama default
    kw['bitnet'] = kw['subln'] = kind == 'bitnet'
    kw['linear_norm'] = kind == 'bitnet' and bool(quant.get('use_rms_norm'))
    kw['weight_scale'] = hf.get('weight_scale', 'matrix')  # ours: no transformers key
    # the old 'bitlinear' class is always packed
    kw['packed'] = kind == 'bitnet' and (mode == 'offline' or linear == 'bitlinear')
    return kw


def config_to_hf(cfg, dtype):
    """A model.ModelConfig as config.json (a dict), for weights of `dtype`."""
    hf = {theirs: getattr(cfg, ours) for ours, theirs in HF_KEYS.items()}
    rope = {'rope_type': 'default'} | (cfg.rope_scaling or {})
    hf.update(rope_theta=cfg.rope_theta, dtype=str(dtype).removeprefix('torch.'),
              mlp_bias=False, rope_parameters=rope | {'rope_theta': cfg.rope_theta},
              model_type=cfg.family, architectures=[FAMILIES[cfg.family][0]])
    if cfg.family == 'mistral':
        hf['sliding_window'] = cfg.sliding_window or None
    if cfg.family.startswith('qwen'):
        hf.update(use_sliding_window=False, sliding_window=None)
    if cfg.n_experts:
        if cfg.attention_bias and MOE_TYPES[cfg.family] == 'qwen2_moe':
            raise ValueError("Qwen2-MoE has no o_proj bias: "
                             "a mixture of experts needs attention_bias=False")
        hf.update(moe_to_hf(cfg, MOE_TYPES[cfg.family]))
    if cfg.bitnet:
        mode = 'offline' if cfg.packed else 'online'
        quant = {'quant_method': 'bitnet', 'linear_class': 'autobitlinear',
                 'quantization_mode': mode}
        if cfg.linear_norm:
            quant.update(use_rms_norm=True, rms_norm_eps=cfg.norm_eps)
        hf.update(model_type='bitnet', architectures=['BitNetForCausalLM'],
                  quantization_config=quant, family=cfg.family)
        # transformers has neither low-rank corrections nor ternary experts, nor (in its
        # BitNet) any family's layers but Llama's nor scales per row, and would drop them
        # silently: these names make it refuse
        if cfg.weight_scale != 'matrix':
            hf['weight_scale'] = cfg.weight_scale
        own = cfg.family != 'llama' or cfg.weight_scale != 'matrix'
        if own or cfg.head_dim * cfg.n_head != cfg.n_embd:
            hf.update(model_type=f'bitnet_{cfg.family}',
                      architectures=[f'BitNet{cfg.family.title()}ForCausalLM'])
        if cfg.lrc_rank:
            hf.update(model_type='bitnet_lrc', architectures=['BitNetLRCForCausalLM'])
        if cfg.n_experts:
            hf.update(model_type='bitnet_moe', architectures=['BitNetMoeForCausalLM'])
    elif cfg.subln or cfg.linear_norm:
        raise ValueError("an fp model with SubLN or linear_norm has no transformers "
                         "class; convert it to BitNet")
    return hf


def read_config(path):
    """A checkpoint directory's config.json as ModelConfig's keyword arguments."""
    if not os.path.isfile(os.path.join(path, 'config.json')):
        raise FileNotFoundError(f"{path!r} is not a checkpoint directory "
                                "(no config.json)")
    with open(os.path.join(path, 'config.json')) as f:
        hf = json.load(f)
    if not isinstance(hf, dict):
        raise ValueError(f"{path}/config.json holds a {type(hf).__name__}, not a JSON object; "
                         f"save the model again")
    for key in NUMBERS:  # a number, not its text: "30" would fail deep inside the model
        if key in hf and hf[key] is not None and type(hf[key]) not in (int, float):
            raise ValueError(f"{path}/config.json: {key} is {hf[key]!r}, not a number; "
                             f"fix it or save the model again")
    return config_from_hf(hf)


def read_weights(path, cfg, dtype, names):
    """A checkpoint directory's tensors under our names, floating ones as `dtype` (packed
    uint8 as they are), checked to be exactly `names` (the model's state_dict keys)."""
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
            raise ValueError(f"cannot read {file} ({e}); "
                             "download or save it again") from None
    sd = {k.removeprefix('model.'): v.to(dtype) if v.is_floating_point() else v
          for k, v in sd.items() if not k.endswith('rotary_emb.inv_freq')}
    with open(os.path.join(path, 'config.json')) as f:
        quant = json.load(f).get('quantization_config') or {}
    if quant.get('linear_class') == 'bitlinear':
        # the old class: 1/gamma ...
        for k in [k for k in sd if k.endswith('weight_scale')]:
            bias = k.removesuffix('weight_scale') + 'bias'
            # ... and adds the bias unscaled; ours is stored as bias / gamma
            if bias in sd:
                sd[bias] = sd[bias] * sd[k]
            sd[k] = 1 / sd[k]
    if MOE_TYPES[cfg.family] == 'mixtral' and cfg.n_experts:
        sd = renamed(sd, MIXTRAL_NAMES, inbound=True)
    if cfg.tie_embeddings:
        sd.pop('lm_head.weight', None)
    if not cfg.n_shared_experts:  # Qwen2-MoE's zero-wide one (it adds 0)
        sd = {k: v for k, v in sd.items() if '.shared_expert' not in k}
    own = {k for k in names if not (cfg.tie_embeddings and k == 'lm_head.weight')}
    missing, unexpected = own - sd.keys(), sd.keys() - own
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match its config.json: "
                         f"missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    return sd


def write(path, state_dict, cfg, dtype):
    """config.json and model.safetensors of a model's state_dict, in the family's names."""
    os.makedirs(path, exist_ok=True)
    sd = {('' if k.startswith('lm_head') else 'model.') + k: v.detach().contiguous()
          for k, v in state_dict.items()}
    if cfg.tie_embeddings:
        # safetensors stores a tensor once; HF re-ties on load
        sd.pop('lm_head.weight')
    moe_type = MOE_TYPES[cfg.family] if cfg.n_experts else None
    if moe_type == 'qwen2_moe' and not cfg.n_shared_experts and not cfg.bitnet:
        # Qwen2-MoE always has a shared expert: a zero-wide one adds exactly 0
        C = cfg.n_embd
        shapes = {'.gate_proj.weight': (0, C), '.up_proj.weight': (0, C),
                  '.down_proj.weight': (C, 0), '_gate.weight': (1, C)}
        for i in range(cfg.n_layer):
            for name, shape in shapes.items():
                sd[f'model.layers.{i}.mlp.shared_expert{name}'] = torch.zeros(shape)
    if moe_type == 'mixtral':
        sd = renamed(sd, MIXTRAL_NAMES)
    hf = config_to_hf(cfg, dtype)  # first: a config it refuses writes nothing
    save_file(sd, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(hf, f, indent=2)
