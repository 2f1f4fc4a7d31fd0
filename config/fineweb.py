# FineWeb (Penedo et al. 2024) as modded-nanogpt trains on it: already tokenized with GPT-2's
# BPE and stored as llm.c shards on the hub (kjj0/fineweb10B-gpt2), read as they are. This
# fetches the val shard and the first 9 of 103 train shards, 100M tokens each (about 200 MB
# each, 2 GB in all). A GPT-2 small sized ternary model, 0.5M tokens per optimizer step:
# 1700 steps are one pass over the 900M tokens downloaded.
out_dir = 'out-fineweb'
tokenizer = 'gpt2'
dataset = 'data/fineweb10B'
prepare = dict(files={'train': [f'hf://datasets/kjj0/fineweb10B-gpt2/fineweb_train_{i:06d}.bin'
                             for i in range(1, 10)],
                      'val': 'hf://datasets/kjj0/fineweb10B-gpt2/fineweb_val_000000.bin'},
               format='tokens')
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 32
arch = dict(n_layer=12, n_embd=768, n_head=12, n_kv_head=12, intermediate_size=2048)
max_steps = 1700
warmup_steps = 100
eval_interval = 100
