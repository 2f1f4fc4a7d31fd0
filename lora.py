"""
LoRA: fine-tune a frozen model through small low-rank adapters (Hu et al. 2021).

Each adapted linear keeps its weights W frozen and learns y = W x + (alpha / r) B A x,
with A (r, in) random and B (out, r) zero, so training starts at the base model and B's
first gradient (grad_y^T A x) is not zero. Around a frozen 2-bit ternary layer
(bitlinear.PackedBitLinear) this is QLoRA (Dettmers et al. 2023) with 2-bit weights
instead of 4-bit: the base takes 16x less memory than fp32 and has no gradients or
optimizer state, so fine-tuning costs little more than inference. Merging B A into W_q
would break its ternary values, so on a ternary base the adapters stay beside the packed
weights; on an fp base `merge_lora` folds them in.

Files use PEFT's adapter layout (adapter_config.json + adapter_model.safetensors): our
module names are PEFT's (`base_layer`, `lora_A`, `lora_B`) behind its prefix, so PEFT
loads our adapters onto transformers' models and we load its adapters onto ours.
"""
import json
import os

import torch
import torch.nn as nn
from safetensors.torch import save_file

from bitlinear import TARGETS

PEFT_PREFIX = 'base_model.model.model.layers.'  # PEFT's name of our model.layers
CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'


class LoRALinear(nn.Module):
    """A frozen linear `base_layer` plus the trainable update (alpha / r) * B(A(x))."""

    def __init__(self, base_layer, rank, alpha):
        super().__init__()
        self.base_layer = base_layer
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        # kaiming, as PEFT
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(module, rank, alpha, targets=TARGETS):
    """In place: wrap every child named in `targets` in a LoRALinear
    (freezing is the caller's)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in targets:
                setattr(parent, name, LoRALinear(child, rank, alpha))
    return module


def attach_lora(model, rank, alpha, targets=TARGETS):
    """QLoRA's set-up: a ternary model's BitLinears frozen to packed 2-bit layers, every
    weight of the model frozen, and adapters on the `targets` of each block."""
    if model.config.bitnet and not model.config.packed:
        model = model.freeze()
    add_lora(model.requires_grad_(False).layers, rank, alpha, targets)
    return model


def check_lora(lora, init_from, fsdp, lambda_warmup):
    """A ValueError for a run's LoRA settings (train.py's `lora`: rank, alpha, targets)
    that cannot work: LoRA adapts a trained model, named targets, without FSDP or a
    quantization warm-up."""
    unknown = set(lora['targets'].split(',')) - set(TARGETS)
    if lora['rank'] and (init_from == 'scratch' or fsdp or lambda_warmup or unknown):
        raise ValueError(f"lora.rank={lora['rank']} adapts a trained model: set init_from, "
                         f"lora.targets among {','.join(TARGETS)}, and no fsdp or "
                         f"lambda_warmup")


def setup_lora(model, lora, adapters=None, path=''):
    """A run's LoRA model (attach_lora with train.py's `lora` settings); a resumed run's
    adapters put back at their exact values (`adapters`, read from the checkpoint `path`)."""
    model = attach_lora(model, lora['rank'], lora['alpha'], lora['targets'].split(','))
    if adapters is not None:
        load_adapters(model.layers, adapters, path)
    return model


def set_adapters(module, on):
    """Switch every LoRA adapter on or off.
    Off (scaling 0, so they add exactly 0), the model is its base, bit for bit: DPO's
    reference without a second copy of the model."""
    for m in module.modules():
        if isinstance(m, LoRALinear):
            m.scaling = m.alpha / m.rank if on else 0.0


@torch.no_grad()
def merge_lora(module):
    """In place: fold each adapter on an fp base into its weights, W += (alpha / r) B A,
    and unwrap it: a plain model again. Adapters on ternary layers stay
    (W_q + B A would not be ternary)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear) and type(child.base_layer) is nn.Linear:
                update = child.lora_B.weight @ child.lora_A.weight
                child.base_layer.weight += child.scaling * update
                setattr(parent, name, child.base_layer)
    return module


# ---------------------------------------------------------------- PEFT's adapter layout

def adapter_state(layers):
    """The adapters of a model's blocks (model.layers),
    keyed as in the blocks' state dict."""
    return {k: v for k, v in layers.state_dict().items() if '.lora_' in k}


def base_state(model):
    """The model's state dict without its adapters:
    its base's, as the base's files hold it."""
    state = model.state_dict()
    return {k.replace('.base_layer.', '.'): v
            for k, v in state.items() if '.lora_' not in k}


def save_adapters(layers, path, rank, alpha, targets, base):
    """Write the adapters of `layers` to the new directory `path` as PEFT does; `base`
    is the directory of the model they adapt."""
    weights = {PEFT_PREFIX + k: v for k, v in adapter_state(layers).items()}
    os.makedirs(path)
    save_file(weights, os.path.join(path, WEIGHTS), metadata={'format': 'pt'})
    config = dict(peft_type='LORA', task_type='CAUSAL_LM', r=rank, lora_alpha=alpha,
                  target_modules=list(targets),
                  base_model_name_or_path=os.path.abspath(base))
    with open(os.path.join(path, CONFIG), 'w') as f:
        json.dump(config, f)


def read_config(path):
    """A LoRA checkpoint's adapter_config.json as a dict, or None for a whole model."""
    file = os.path.join(path, CONFIG)
    if not os.path.exists(file):
        return None
    with open(file) as f:
        return json.load(f)


def load_adapters(layers, weights, path):
    """Load PEFT-layout adapter weights (checkpoint.adapter_weights of the checkpoint at
    `path`) into the LoRALinears of `layers`."""
    weights = {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()}
    wrong = layers.load_state_dict(weights, strict=False)
    if wrong.unexpected_keys or any('.lora_' in k for k in wrong.missing_keys):
        raise ValueError(f"{path}/{WEIGHTS} does not hold the adapters {CONFIG} names")
    return layers
