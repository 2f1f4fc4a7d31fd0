"""
A mixture-of-experts MLP: many MLPs ("experts"), of which each token uses only a few
(Shazeer et al. 2017, "Outrageously Large Neural Networks"; Switch Transformer, Fedus et
al. 2021). A linear router scores the experts for each token; the token goes to its top_k
experts by softmax probability, and the layer's output is the sum of their outputs
weighted by those probabilities, renormalised over the top_k when `norm_topk_prob` (as
Mixtral does; Qwen2-MoE leaves them as they are by default). A shared expert, when there
is one, sees every token, its output scaled by a sigmoid gate (Qwen2-MoE). The module
names are Qwen2-MoE's and Qwen3-MoE's: `gate` (the router),
`experts.{i}.{gate,up,down}_proj`, `shared_expert`, `shared_expert_gate` (Mixtral's
`block_sparse_moe.experts.{i}.w1/w3/w2` are renamed on the way in and out, model.py). The
released families differ only in settings: Mixtral renormalises its top_k and has no
shared expert; Qwen3-MoE has no shared expert and a norm_topk_prob setting; Qwen2-MoE
always has a shared expert (ours writes a zero-wide one when there is none).

The parameters grow with the number of experts, the work per token with top_k only: the
(token, expert) pairs are sorted by expert, so that each expert gathers its tokens once and
runs once, on them alone (no dense loop that runs every expert on every token). In a
ternary model the experts are BitLinear MLPs while the router stays full precision: a
routing decision is a comparison of small logits, which ternary weights would blur. At
decode time each active expert's weights are read once per token, so the experts' bytes
(2 bits a weight once packed) are the cost.

The router would send every token to the same few experts if nothing stopped it; the
auxiliary losses that keep the load balanced read the router logits this layer hands out
(objectives.py). Sparse upcycling (Komatsuzaki et al. 2022) starts an MoE from a dense
model: each expert a copy of its MLP, the router new.

This file needs only torch. `expert(hidden)` builds one expert with that hidden size
(model.py: a gated MLP); `cfg` has n_embd, n_experts, top_k, norm_topk_prob,
n_shared_experts and moe_intermediate_size; `moe_from_hf` reads them from a Qwen2-MoE,
Qwen3-MoE or Mixtral config.json, `moe_to_hf` writes them.
"""
import copy

import torch
import torch.nn as nn


class MoE(nn.Module):

    def __init__(self, cfg, expert):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)  # the router
        H = cfg.moe_intermediate_size
        self.experts = nn.ModuleList(expert(H) for _ in range(cfg.n_experts))
        self.shared_expert = None
        if cfg.n_shared_experts:  # as wide as n_shared_experts experts
            self.shared_expert = expert(cfg.n_shared_experts * H)
            self.shared_expert_gate = nn.Linear(cfg.n_embd, 1, bias=False)

    def route(self, logits):
        """Each token's top_k experts (N, k) and their weights (N, k), from the router
        logits (N, n_experts); the softmax in fp32."""
        probs = logits.float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def forward(self, x, router=None):
        """x (B, T, C) -> (B, T, C). `router`, a list, gets the router logits."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C), N = B * T tokens
        logits = self.gate(x)  # (N, n_experts)
        if router is not None:
            router.append(logits)
        weights, chosen = self.route(logits)
        # the N * k (token, expert) pairs sorted by expert: each expert's pairs are a slice
        order = chosen.flatten().argsort(stable=True)
        counts = chosen.flatten().bincount(minlength=len(self.experts)).tolist()
        tokens = order // self.top_k  # the token of each sorted pair
        pair_weights = weights.flatten()[order]
        y = torch.zeros_like(x)
        for expert, rows, w in zip(self.experts, tokens.split(counts),
                                   pair_weights.split(counts)):
            # in training an expert without tokens still runs (on none), so that every
            # expert has a gradient, if zero, on every rank (DDP and FSDP expect one)
            if len(rows) or torch.is_grad_enabled():
                out = expert(x[rows]) * w[:, None]  # (tokens of this expert, C)
                y.index_add_(0, rows, out.to(y.dtype))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.view(shape)


def upcycle(mlp, cfg):
    """Sparse upcycling: an MoE whose experts are copies of the dense `mlp` (so
    cfg.moe_intermediate_size is its hidden size) and whose router is new, small
    random weights (std 0.02). With norm_topk_prob and no shared expert it computes
    exactly what `mlp` did."""
    moe = MoE(cfg, lambda hidden: copy.deepcopy(mlp))
    nn.init.normal_(moe.gate.weight, std=0.02)
    return moe


# the MoE model_type of each dense family (model.py), its transformers class, and its
# config.json's names for the settings above
MOE_TYPES = {'llama': 'qwen2_moe', 'qwen2': 'qwen2_moe', 'qwen3': 'qwen3_moe',
             'mistral': 'mixtral'}
MOE_CLASSES = {'qwen2_moe': 'Qwen2MoeForCausalLM', 'qwen3_moe': 'Qwen3MoeForCausalLM',
               'mixtral': 'MixtralForCausalLM'}
QWEN_KEYS = dict(n_experts='num_experts', top_k='num_experts_per_tok',
                 norm_topk_prob='norm_topk_prob', moe_intermediate_size='moe_intermediate_size')
MOE_KEYS = {'qwen2_moe': QWEN_KEYS, 'qwen3_moe': QWEN_KEYS,
            'mixtral': dict(n_experts='num_local_experts', top_k='num_experts_per_tok',
                            moe_intermediate_size='intermediate_size')}


def moe_from_hf(hf, kind):
    """The MoE settings of a config.json of `kind` (a MOE_CLASSES key; ours, ternary, as
    its family's), refusing what our MoE lacks."""
    if hf.get('mlp_only_layers') or hf.get('decoder_sparse_step', 1) > 1:
        raise ValueError(f"{kind} with dense layers (mlp_only_layers, decoder_sparse_step) "
                         "is not supported: every layer here is MoE")
    kw = {ours: hf[theirs] for ours, theirs in MOE_KEYS[kind].items() if theirs in hf}
    # the released files and transformers' own name the count either way
    kw['n_experts'] = hf.get('num_experts') or hf.get('num_local_experts')
    kw.setdefault('norm_topk_prob', kind == 'mixtral')  # Qwen's default: not renormalised
    shared = hf.get('shared_expert_intermediate_size', 0)
    if shared % kw['moe_intermediate_size']:
        raise ValueError(f"shared_expert_intermediate_size {shared} is no multiple of "
                         f"moe_intermediate_size {kw['moe_intermediate_size']}")
    kw['n_shared_experts'] = shared // kw['moe_intermediate_size']
    return kw


def moe_to_hf(cfg, kind):
    """The config.json keys of an MoE of `kind`, refusing what that family cannot hold."""
    if kind != 'qwen2_moe' and cfg.n_shared_experts:
        raise ValueError(f"{kind} has no shared expert: use n_shared_experts=0")
    if kind == 'mixtral' and not cfg.norm_topk_prob:
        raise ValueError("Mixtral renormalises its top_k weights: use norm_topk_prob=True")
    hf = {theirs: getattr(cfg, ours) for ours, theirs in MOE_KEYS[kind].items()}
    hf.update(model_type=kind, architectures=[MOE_CLASSES[kind]])
    if kind == 'qwen2_moe':
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
        hf.update(shared_expert_intermediate_size=shared, qkv_bias=cfg.qkv_bias)
    if kind == 'qwen3_moe':
        hf.update(decoder_sparse_step=1, mlp_only_layers=[])
    return hf
