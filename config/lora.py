# LoRA (Hu et al. 2021) on a frozen ternary model: the base stays packed at 2 bits per weight, as
# QLoRA (Dettmers et al. 2023) keeps its base at 4, and only rank-16 fp adapters on every attention
# and MLP matrix train, with their AdamW state. Train the default model first (python train.py),
# then:   python train.py config/lora.py
# config/chat.jsonl holds 224 conversations made from the offline corpus's pydoc topics (a
# paragraph's first sentence asked about, the rest of it as the answer), config/chat_val.jsonl 32
# more, held out; the loss counts only the answers. No download. Checkpoints hold the adapters alone,
# in PEFT's layout (adapter_config.json names the base); python sample.py --ckpt=out-lora runs them.
# On another base (an HF directory, e.g. a SmolLM2 made ternary), point init_from at it and give the
# data its own folder: the shards are tokenized with the base's tokenizer.
out_dir = 'out-lora'
init_from = 'out'      # the default run's latest checkpoint
dataset = 'data/chat-lora'
prepare = dict(files={'train': 'config/chat.jsonl', 'val': 'config/chat_val.jsonl'}, format='chat')
lora = dict(rank=16, alpha=32.0)
max_steps = 200
warmup_steps = 10
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.0
eval_interval = 50
