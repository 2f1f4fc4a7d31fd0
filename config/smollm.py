# SmolLM2-135M (Allal et al. 2025) turned ternary: the command this project is for.
#   torchrun --nproc_per_node=8 train.py config/smollm.py
# The first run downloads, once, into ~/.cache/nanobitnet (HF_ENDPOINT and HF_TOKEN apply;
# under torchrun only local rank 0 downloads, the other ranks wait and then load):
#   HuggingFaceTB/SmolLM2-135M: config.json, model.safetensors (269 MB, bf16), tokenizer.json (2.1 MB)
#   roneneldan/TinyStories: TinyStoriesV2-GPT4-train.txt (2.2 GB) and -valid.txt (22 MB),
#   tokenized with the SmolLM2 tokenizer into data/tinystories-smollm2 (about 0.5B tokens)
# The student is the model converted to BitNet with SubLN (gains calibrated on the first batches),
# ternary from the first step; the teacher is the fp original, frozen. The recipe is the one that
# won `sweeps/convert.py` on SmolLM2-135M-Instruct (docs/conversion.md): for the first third of
# the steps, block-wise reconstruction alone (each block, fed the fp block's input, learns to give
# its output), then CE + logits KD at T = 5, LR 1e-3, no weight decay; at the switch AdamW's
# moments start afresh and the LR warms up again over warmup_steps (phase_reset). There it
# closed 58% of the CE-only student's gap to the teacher at 246k tokens (CE + KD from the
# start: 39%), with the moments carried across the switch, as they were then. Each ternary
# matrix has one absmean weight scale per output row: at 61k tokens (sweeps/phase_switch.py)
# it beat one scale per matrix at each of three seeds, by 0.24-0.37 nats on the val windows,
# and its CE never rose above its value at the switch. Its checkpoint saves under our own
# model_type, bitnet_llama (transformers' BitNet takes one scale per matrix):
# sample.py, eval.py and the GGUF export open it; --weight_scale=matrix gives a checkpoint that
# transformers opens as BitNetForCausalLM. Block-wise reconstruction runs on several ranks under
# FSDP (DDP cannot follow a teacher-forced block), so torchrun turns fsdp on.
# The model's own tokenizer.json tokenizes the data. Offline, download those files elsewhere and
# point at them: --init_from=DIR --teacher=DIR (a folder with config.json, model.safetensors,
# tokenizer.json) and --prepare.files="{'train': 'train.txt', 'val': 'valid.txt'}".
import os

import torch

out_dir = 'out-smollm'
init_from = 'HuggingFaceTB/SmolLM2-135M'
teacher = 'HuggingFaceTB/SmolLM2-135M'
dataset = 'data/tinystories-smollm2'
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
if torch.cuda.is_available():  # per GPU: 16 x 1024 tokens; 8 GPUs x 2 micro-steps = 262k tokens per step
    batch_size, block_size, gradient_accumulation_steps, compile = 16, 1024, 16, True
else:  # a CPU can run it, slowly: small batches, so that a step takes seconds, not minutes
    batch_size, block_size, gradient_accumulation_steps = 4, 256, 2
