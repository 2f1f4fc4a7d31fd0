# GRPO (Shao et al. 2024) on the offline arithmetic task of rl.py: SmolLM2-135M-Instruct samples 8
# answers to each of 4 problems per step and is pushed toward those that end in the right
# `#### <number>`. No download besides the model; no value model, no reference (beta = 0).
#   python train.py config/grpo.py
#   python train.py config/grpo.py --init_from=DIR     # offline: a folder with the model
# Held-out: 200 problems no training prompt repeats (rl.py's first split), answered greedily
# at every eval (heldout_correct_answer in log.jsonl);
# `python rl.py --ckpt=out-grpo --split=heldout` scores a checkpoint the same way.
# LoRA on a ternary model (its base packed, the adapters trained):
#   python train.py config/grpo.py --init_from=<a ternary checkpoint> --lora.rank=16 \
#       --learning_rate=1e-4 --out_dir=out-grpo-lora
out_dir = 'out-grpo'
init_from = 'HuggingFaceTB/SmolLM2-135M-Instruct'
bitnet = False
# correct_answer alone: with `format` beside it the model learns within 10 steps to write
# `#### <number>` at once, without working the sum out, and its held-out accuracy falls
# (docs/grpo.md); 0.7 makes a right answer among 8 samples likelier than 1.0 does
grpo = dict(data='arithmetic', heldout='arithmetic_heldout', group=8, max_new_tokens=48,
            temperature=0.7, top_p=1.0, rewards=['correct_answer'], scale_rewards='group',
            iterations=1)
objectives = {'grpo': {'beta': 0.0, 'loss_type': 'grpo'}}
curriculum = [(1.0, {'grpo': 1.0})]
batch_size = 4         # prompts per micro-step (x group completions)
gradient_accumulation_steps = 1
block_size = 128       # the val loss on the offline corpus: does language modeling suffer?
eval_iters = 4
max_steps = 30
eval_interval = 10
log_interval = 1
learning_rate = 2e-5
min_lr = 2e-5
schedule = 'constant'
warmup_steps = 3
weight_decay = 0.0
sample = dict(tokens=0)
