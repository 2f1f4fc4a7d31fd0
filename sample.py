"""
Generate text from a checkpoint:

    python sample.py                          # the latest checkpoint in out/
    python sample.py --ckpt=out/ckpt_0000300 --prompt="def " --num_tokens=200

`ckpt` is a checkpoint directory written by train.py or any Hugging Face Llama/BitNet
directory; an out_dir picks its latest checkpoint. A ternary model runs packed (2-bit weights
and the int8 kernels of kernels.py) unless --packed=False. Prints the text, the decode speed
and the memory the weights take.
"""
import os
import sys
import time

import torch

from configurator import configure
from data import get_tokenizer
from model import Transformer

ckpt = 'out'
prompt = 'The '
num_tokens = 200
temperature = 0.8
top_k = 50
seed = 1337
tokenizer = ''  # '' means the one the checkpoint was trained with
packed = True  # run ternary checkpoints on their 2-bit weights (False: fp latent weights, fake-quantized)
device = 'cuda' if torch.cuda.is_available() else 'cpu'
config = configure({k: v for k, v in globals().items() if not k.startswith('_') and
                    isinstance(v, (int, float, str))}, sys.argv[1:])
globals().update(config)

if os.path.isdir(ckpt) and not os.path.exists(os.path.join(ckpt, 'config.json')):
    found = sorted(n for n in os.listdir(ckpt) if n.startswith('ckpt_'))
    if not found:
        sys.exit(f"error: no checkpoint in {ckpt!r}; train one with python train.py or pass --ckpt=DIR")
    ckpt = os.path.join(ckpt, found[-1])
try:
    model = Transformer.from_pretrained(ckpt).to(device).eval()
except (OSError, ValueError, RuntimeError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
if packed and model.config.bitnet and not model.config.packed:
    model.freeze()
weights = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n.endswith(('weight', 'weight_scale'))}
weight_mb = sum(t.nbytes for t in weights.values()) / 2**20
state_file = os.path.join(ckpt, 'train_state.pt')
if not tokenizer:
    tokenizer = torch.load(state_file, weights_only=True)['config']['tokenizer'] if os.path.exists(state_file) else 'bytes'
enc = get_tokenizer(tokenizer)

torch.manual_seed(seed)
idx = torch.tensor([enc.encode_ordinary(prompt)], device=device)
num_tokens = min(num_tokens, model.config.max_seq_len - idx.size(1))
with torch.no_grad():
    model(idx[:, :1])  # warm-up, so that a first-use kernel build is not timed
t0 = time.time()
out = model.generate(idx, num_tokens, temperature=temperature, top_k=top_k, vocab=enc.n_vocab)
dt = time.time() - t0
print(enc.decode(out[0].tolist()))
kind = 'packed ternary' if model.config.packed else 'ternary (fake-quantized)' if model.config.bitnet else 'fp'
print(f"--- {ckpt}: {kind}, weights {weight_mb:.1f} MiB, {num_tokens / dt:.1f} tokens/s")
