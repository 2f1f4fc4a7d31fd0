"""
Generate text from a checkpoint, or chat with it:

    python sample.py                          # the newest intact checkpoint in out/
    python sample.py --ckpt=out/ckpt_0000750 --prompt="def " --num_tokens=200
    python sample.py --ckpt=out-lora                 # a base model with LoRA adapters
    python sample.py --ckpt=HuggingFaceTB/SmolLM2-135M-Instruct --chat=True --prompt="Hi"
    python sample.py --ckpt=out --judge=TEACHER_DIR   # also the teacher's nats on the text
    python sample.py --chat=True --prompts=config/chat_prompts.txt   # one prompt a line

`ckpt` is a run's folder, a checkpoint, a Hugging Face Llama/BitNet directory or a hub id,
opened as every script opens one (checkpoint.load). A ternary model runs packed (2-bit
weights, kernels.py) and fused (engine.fuse) unless --packed=False. Prints the text, the
decode speed and the weights' memory. A LoRA checkpoint (PEFT's files) is loaded onto the
base its adapter_config.json names: on an fp base the adapters are merged into the weights,
on a ternary base they run beside the packed weights. Writing a checkpoint for llama.cpp,
or a LoRA model merged, is export.py's job.
"""
import sys
import time

import torch
import torch.nn.functional as F

import checkpoint
from configurator import configure
from engine import fuse, generate, weight_bytes
from lora import merge_lora
from tokenizer import chat_prompt, chat_template, get_tokenizer, same_encoding

ckpt = 'out'
prompt = 'The '
prompts = ''           # a file of prompts, one a line, each sampled in turn (not prompt)
num_tokens = 200
temperature = 0.8      # 0: greedy
top_k = 50
chat = False           # the prompt is a user's message in the chat template
seed = 1337
tokenizer = ''         # '' is the checkpoint's own, or the one it was trained with
packed = True          # ternary models on 2-bit weights (False: fake-quantized)
judge = ''             # another model (a teacher) that scores the text: its nats/token
device = 'cuda' if torch.cuda.is_available() else 'cpu'
settings = {k: v for k, v in globals().items() if isinstance(v, (int, float, str))}
settings = {k: v for k, v in settings.items() if not k.startswith('_')}
ranges = {'prompt': 'non-empty', 'num_tokens': 'positive', 'temperature': 'non-negative',
          'top_k': 'positive'}
config = configure(settings, sys.argv[1:], ranges)
globals().update(config)
if device.startswith('cuda') and not torch.cuda.is_available():
    sys.exit(f"error: device={device!r}, but this torch sees no CUDA GPU; set --device=cpu")

try:
    if prompts:
        with open(prompts, encoding='utf-8') as f:
            texts = [line.rstrip('\n') for line in f if line.strip()]
    else:
        texts = [prompt]
except (OSError, UnicodeDecodeError) as e:
    sys.exit(f"error: cannot read --prompts={prompts}: {e}")
if not texts:
    sys.exit(f"error: --prompts={prompts} holds no prompt; write one a line")
try:
    ckpt, model, tokenizer = checkpoint.load(ckpt, device, packed, tokenizer)
except (OSError, ValueError, RuntimeError, KeyError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
if judge:
    try:
        judge, judge_model, judge_tokenizer = checkpoint.load(judge, device)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        sys.exit(f"error: cannot load the judge {judge!r}: {e}")
    if not same_encoding(get_tokenizer(judge_tokenizer), get_tokenizer(tokenizer)):
        sys.exit(f"error: the judge {judge!r} has another tokenizer than the model; "
                 "it can only score text in the same tokens")
merge_lora(model)  # an fp base's adapters are folded into it; a ternary base keeps them
try:
    enc = get_tokenizer(tokenizer)
    end = chat_template(enc)[2] if chat else ''  # the token that ends an answer
    encoded = [chat_prompt(enc, t) if chat else enc.encode_ordinary(t) for t in texts]
except (OSError, ValueError) as e:
    sys.exit(f"error: tokenizer {tokenizer!r}: {e}")
for i, ids in enumerate(encoded):
    if len(ids) >= model.config.max_seq_len:
        sys.exit(f"error: prompt {i + 1} is {len(ids)} tokens, and the model's window "
                 f"{model.config.max_seq_len}; shorten it")

if model.config.packed:
    fuse(model)  # faster decode: q/k/v and gate/up fused, an int8 head
kind = 'fp'
if model.config.bitnet:
    kind = 'packed ternary' if model.config.packed else 'ternary (fake-quantized)'
weight_mb = weight_bytes(model) / 2**20  # what decoding reads per token
stop = enc.encode_single_token(end) if chat else None
with torch.no_grad():
    model(torch.tensor([encoded[0][:1]], device=device))  # warm-up: no kernel build timed
for ids in encoded:
    torch.manual_seed(seed)  # each prompt sampled as if alone
    idx = torch.tensor([ids], device=device)
    room = min(num_tokens, model.config.max_seq_len - idx.size(1))
    t0 = time.time()
    out = generate(model, idx, room, temperature, top_k, stop, enc.n_vocab)[0].tolist()
    dt, new_tokens = time.time() - t0, len(out) - idx.size(1)
    print(enc.decode(out[idx.size(1):] if chat else out).removesuffix(end))  # chat: the answer
    print(f"--- {ckpt}: {kind}, weights {weight_mb:.1f} MiB, {new_tokens / dt:.1f} tokens/s")
    if judge and new_tokens:  # how likely the judge finds the new tokens after the prompt
        new = torch.tensor([out], device=device)
        with torch.no_grad():
            logits = judge_model(new[:, :-1])[0, idx.size(1) - 1:].float()
        nats = F.cross_entropy(logits, new[0, idx.size(1):]).item()
        print(f"--- judge {judge}: {nats:.3f} nats/token on the {new_tokens} new tokens")
