# TinyStories (Eldan & Li 2023): short stories in simple English, written by GPT-4, on which
# small models learn fluent text quickly. The first run downloads the two raw text files from
# the hub (TinyStoriesV2-GPT4-train.txt, about 2.2 GB; -valid.txt, 22.5 MB), tokenizes them
# with GPT-2's BPE on every core into data/tinystories, and later runs reuse the shards.
# Stories are separated by <|endoftext|> in these files; each becomes one document.
out_dir = 'out-tinystories'
tokenizer = 'gpt2'
dataset = 'data/tinystories'
prepare = dict(files={'train': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-train.txt',
                      'val': 'hf://datasets/roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt'},
               format='text')
block_size = 512
batch_size = 32
arch = dict(n_layer=8, n_embd=512, n_head=8, n_kv_head=8, intermediate_size=1376)
max_steps = 5000
warmup_steps = 200
eval_interval = 250
