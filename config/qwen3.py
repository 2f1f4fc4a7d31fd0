# Qwen3-0.6B (Qwen team 2025) made ternary the way BitDistill (Wu et al. 2025) does it:
#   torchrun --nproc_per_node=8 train.py config/qwen3.py
# The first run downloads, once, into ~/.cache/nanobitnet (HF_ENDPOINT and HF_TOKEN apply):
#   Qwen/Qwen3-0.6B: config.json, model.safetensors (0.6B parameters in bf16: 1.2 GB of
#   weights, 1.5 GB if the file holds the tied head twice), tokenizer.json (about 11 MB)
#   roneneldan/TinyStories: TinyStoriesV2-GPT4-train.txt (2.2 GB) and -valid.txt (22 MB),
#   tokenized with Qwen's tokenizer into data/tinystories-qwen3
# Qwen3's layers as loaded: q/k RMSNorm per head, 16 heads of 128 on a width of 1024 (head_dim
# apart from the width), RoPE theta 1e6, tied embeddings. BitDistill's three stages: the model
# converted to BitNet with SubLN (gains calibrated on the first batches), continued training on
# cross-entropy alone (the first 40% of the steps), then CE + logits KD (T = 5) + attention-
# relation KD on the last layer, the fp original as the frozen teacher (the weights are those
# of config/bitdistill.py, which keep the three terms within an order of magnitude). The
# ternary checkpoint saves under model_type bitnet_qwen3 (transformers' BitNet has no q/k norm);
# llama.cpp's bitnet architecture has none either, so its GGUF export refuses it in one line.
# Offline: --init_from=DIR --teacher=DIR (config.json, model.safetensors, tokenizer.json) and
# --prepare.files="{'train': 'train.txt', 'val': 'valid.txt'}".
import os

import torch

out_dir = 'out-qwen3'
init_from = 'Qwen/Qwen3-0.6B'
teacher = 'Qwen/Qwen3-0.6B'
dataset = 'data/tinystories-qwen3'
prepare = dict(files={'train': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-train.txt',
                      'val': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt'})
bitnet = True
objectives = {'ce': {}, 'kd': {'temperature': 5.0}, 'attn': {'layer': -1, 'heads': 8}}
curriculum = [(0.4, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'attn': 10.0})]
fsdp = int(os.environ.get('WORLD_SIZE', 1)) > 1
max_steps = 2000
warmup_steps = 100
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.0
eval_interval = 200
if torch.cuda.is_available():  # per GPU: 8 x 1024 tokens (a 152k vocabulary makes big logits);
    # 8 GPUs x 4 micro-steps = 262k tokens per step
    batch_size, block_size, gradient_accumulation_steps, compile = 8, 1024, 32, True
else:  # a CPU can run it, slowly
    batch_size, block_size, gradient_accumulation_steps = 2, 256, 2
