# Llama-3.2-1B (Meta 2024) made ternary with config/smollm.py's recipe:
#   torchrun --nproc_per_node=8 train.py config/llama3.py
# The model is gated: accept its licence on the hub and set HF_TOKEN. The first run downloads,
# once, into ~/.cache/nanobitnet (HF_ENDPOINT and HF_TOKEN apply):
#   meta-llama/Llama-3.2-1B: config.json, model.safetensors (1.24B parameters in bf16, 2.5 GB),
#   tokenizer.json (about 9 MB)
#   roneneldan/TinyStories: TinyStoriesV2-GPT4-train.txt (2.2 GB) and -valid.txt (22 MB),
#   tokenized with Llama 3's tokenizer into data/tinystories-llama3
# Llama 3's layers as loaded: its RoPE frequency scaling ('llama3': the slow frequencies divided
# by 32, the fast ones kept), 32 heads of 64 with 8 KV heads, a 128k vocabulary, tied embeddings.
# The recipe is config/smollm.py's (docs/conversion.md): block-wise reconstruction alone for the
# first third of the steps, then CE + logits KD at T = 5, one weight scale per output row, the fp
# original as the frozen teacher. The ternary checkpoint saves under our own model_type,
# bitnet_llama (--weight_scale=matrix: one transformers opens as BitNetForCausalLM); its rows of
# 2048 and 8192 export to llama.cpp's TQ2_0/TQ1_0, which store a row's scale in each of its
# blocks of 256.
# Offline: --init_from=DIR --teacher=DIR (config.json, model.safetensors, tokenizer.json) and
# --prepare.files="{'train': 'train.txt', 'val': 'valid.txt'}".
import os

import torch

out_dir = 'out-llama3'
init_from = 'meta-llama/Llama-3.2-1B'
teacher = 'meta-llama/Llama-3.2-1B'
dataset = 'data/tinystories-llama3'
prepare = dict(files={'train': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-train.txt',
                      'val': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt'})
bitnet = True
weight_scale = 'row'
objectives = {'block': {}, 'ce': {}, 'kd': {'temperature': 5.0}}
curriculum = [(1 / 3, {'block': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0})]
fsdp = int(os.environ.get('WORLD_SIZE', 1)) > 1
max_steps = 2000
warmup_steps = 100
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.0
eval_interval = 200
if torch.cuda.is_available():  # per GPU: 8 x 1024 tokens; 8 GPUs x 4 micro-steps = 262k per step
    batch_size, block_size, gradient_accumulation_steps, compile = 8, 1024, 32, True
else:  # a CPU can run it, slowly
    batch_size, block_size, gradient_accumulation_steps = 2, 256, 2
