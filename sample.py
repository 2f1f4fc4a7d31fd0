"""
Generate text from a checkpoint:

    python sample.py                          # the newest intact checkpoint in out/
    python sample.py --ckpt=out/ckpt_0000750 --prompt="def " --num_tokens=200
    python sample.py --ckpt=out --export=model.gguf  # write it for llama.cpp instead
    python sample.py --ckpt=out-lora                 # a base model with LoRA adapters

`ckpt` is a run's folder, a checkpoint, a Hugging Face Llama/BitNet directory or a hub id,
found as train.py finds one (engine.load). A ternary model runs packed (2-bit weights,
kernels.py) and fused (engine.fuse) unless --packed=False. Prints the text, the decode
speed and the weights' memory. --export=FILE writes a GGUF file that llama.cpp runs
(gguf_export.py), with the tokenizer and its chat template.

A LoRA checkpoint (PEFT's files) is loaded onto the base its adapter_config.json names. On
an fp base the adapters are merged into the weights (--merge=DIR writes that model). On a
ternary base they stay beside the packed weights (W_q + B A is not ternary), and
--export=M.gguf writes the base to M.gguf and the adapters to M-lora.gguf, the file
llama.cpp applies them from (llama-cli -m M.gguf --lora M-lora.gguf).
"""
import os
import sys
import time

import torch

import checkpoint
from configurator import configure
from engine import fuse, generate, load, weight_bytes
from gguf_export import gguf_vocab, save_gguf, save_lora_gguf
from lora import adapter_state, base_state, merge_lora, read_config
from tokenizer import chat_prompt, chat_template, chat_template_text, get_tokenizer

ckpt = 'out'
prompt = 'The '
num_tokens = 200
temperature = 0.8      # 0: greedy
top_k = 50
chat = False           # the prompt is a user's message in the chat template
seed = 1337
tokenizer = ''         # '' is the checkpoint's own, or the one it was trained with
packed = True          # ternary models on 2-bit weights (False: fake-quantized)
device = 'cuda' if torch.cuda.is_available() else 'cpu'
export = ''            # a path: write the checkpoint there as GGUF for llama.cpp instead
export_ternary = 'tq2_0'  # or 'tq1_0' (smaller, slower), 'q8_0', 'f16'
export_dtype = 'float32'  # of the embedding (and head), and an fp model's matrices:
                          # 'float32', 'float16', or 'q8_0' (matrices; embedding float32)
merge = ''             # LoRA on an fp base: write the merged model there instead
settings = {k: v for k, v in globals().items() if isinstance(v, (int, float, str))}
settings = {k: v for k, v in settings.items() if not k.startswith('_')}
ranges = {'prompt': 'non-empty', 'num_tokens': 'positive', 'temperature': 'non-negative',
          'top_k': 'positive', 'export_ternary': ('tq2_0', 'tq1_0', 'q8_0', 'f16'),
          'export_dtype': ('float32', 'float16', 'q8_0')}
config = configure(settings, sys.argv[1:], ranges)
globals().update(config)

try:
    ckpt, model, tokenizer = load(ckpt, device, packed, tokenizer)
    lora = read_config(ckpt)
except (OSError, ValueError, RuntimeError, KeyError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
merge_lora(model)  # an fp base's adapters are folded into it; a ternary base keeps them
if merge and not lora:
    sys.exit(f"error: --merge takes a LoRA checkpoint (with adapter_config.json); "
             f"{ckpt} is a whole model")
if merge and model.config.bitnet:
    sys.exit("error: LoRA adapters on a ternary base cannot be merged (W_q + B A is not "
             "ternary); sample from the checkpoint, or --export it to GGUF (the adapters "
             "go to a file of their own)")
if merge:
    model.save_pretrained(merge)
    if os.path.exists(os.path.join(ckpt, 'tokenizer.json')):
        checkpoint.copy_tokenizer(os.path.join(ckpt, 'tokenizer.json'), merge)
    print(f"wrote {merge}: the base with its LoRA adapters merged")
    sys.exit()
try:
    enc = get_tokenizer(tokenizer)
    end = chat_template(enc)[2] if chat else ''  # the token that ends an answer
    ids = chat_prompt(enc, prompt) if chat else enc.encode_ordinary(prompt)
except (OSError, ValueError) as e:
    sys.exit(f"error: tokenizer {tokenizer!r}: {e}")
if not export and len(ids) >= model.config.max_seq_len:
    sys.exit(f"error: the prompt is {len(ids)} tokens, and the model's window "
             f"{model.config.max_seq_len}; shorten --prompt")

if export:
    vocab = gguf_vocab(enc, model.config.vocab_size)
    template = chat_template_text(ckpt)
    if template is not None:
        vocab['tokenizer.chat_template'] = template
    adapters = lora and model.config.bitnet  # (an fp base's are merged into it above)
    weights = base_state(model)  # the base; its adapters go to a file of their own
    try:
        save_gguf(export, weights, model.config, vocab, export_ternary,
                  getattr(torch, export_dtype, export_dtype))
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot export {ckpt!r} to GGUF: {e}")
    print(f"wrote {export}: {os.path.getsize(export) / 2**20:.1f} MiB")
    if adapters:
        path = export.removesuffix('.gguf') + '-lora.gguf'
        save_lora_gguf(path, adapter_state(model.layers), lora['lora_alpha'])
        print(f"wrote {path}: the adapters "
              f"(llama-cli -m BASE.gguf --lora {os.path.basename(path)})")
    sys.exit()

if model.config.packed:
    fuse(model)  # faster decode: q/k/v and gate/up fused, an int8 head
torch.manual_seed(seed)
idx = torch.tensor([ids], device=device)
num_tokens = min(num_tokens, model.config.max_seq_len - idx.size(1))
with torch.no_grad():
    model(idx[:, :1])  # warm-up, so that a first-use kernel build is not timed
t0 = time.time()
stop = enc.encode_single_token(end) if chat else None
out = generate(model, idx, num_tokens, temperature, top_k, stop, enc.n_vocab)[0].tolist()
dt, num_tokens = time.time() - t0, len(out) - idx.size(1)
print(enc.decode(out[idx.size(1):] if chat else out).removesuffix(end))  # chat: the answer
kind = 'fp'
if model.config.bitnet:
    kind = 'packed ternary' if model.config.packed else 'ternary (fake-quantized)'
weight_mb = weight_bytes(model) / 2**20  # what decoding reads per token
print(f"--- {ckpt}: {kind}, weights {weight_mb:.1f} MiB, {num_tokens / dt:.1f} tokens/s")
