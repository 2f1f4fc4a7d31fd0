"""
Write a checkpoint in another form:

    python export.py --gguf=model.gguf              # out/'s newest checkpoint, for llama.cpp
    python export.py --ckpt=out-lora --gguf=m.gguf  # a ternary base + its LoRA adapters
    python export.py --ckpt=out-lora --merge=m      # LoRA on an fp base, merged: one model

`ckpt` is a run's folder, a checkpoint, a Hugging Face Llama/BitNet directory or
a hub id, opened as every script opens one (checkpoint.load). --gguf=FILE writes
a GGUF file that llama.cpp runs (gguf_export.py), with the tokenizer and its chat
template: ternary matrices in TQ2_0 (or --ternary; rows not a multiple of 256 long in
Q4_0), an fp model's matrices in --dtype; the embedding (the head) of a ternary model
in Q8_0, of an fp one in --dtype (or --embedding).

A LoRA checkpoint (PEFT's files) is loaded onto the base its adapter_config.json
names. On an fp base --merge=DIR folds the adapters into the weights and writes
that model (--gguf writes the merged one). On a ternary base they stay beside the
packed weights (W_q + B A is not ternary): --gguf=M.gguf writes the base to M.gguf
and the adapters to M-lora.gguf, the file llama.cpp applies them from
(llama-cli -m M.gguf --lora M-lora.gguf).
"""
import os
import sys

import torch

import checkpoint
from configurator import configure
from gguf_export import gguf_vocab, save_gguf, save_lora_gguf
from lora import adapter_state, base_state, merge_lora, read_config
from tokenizer import chat_template_text, get_tokenizer

ckpt = 'out'
gguf = ''              # write the checkpoint here as a GGUF file for llama.cpp
ternary = 'tq2_0'      # GGUF type of the ternary matrices: or 'tq1_0' (smaller, slower),
                       # 'q4_0', 'q8_0', 'f16'
dtype = 'float32'      # of an fp model's matrices (and embedding): 'float32', 'float16',
                       # or 'q8_0' (matrices; embedding float32)
embedding = 'auto'     # the embedding and head: 'q8_0', or 'dtype' (as --dtype); 'auto':
                       # q8_0 for a ternary model (docs/llama_cpp.md), dtype for an fp one
merge = ''             # LoRA on an fp base: write the merged model to this directory
tokenizer = ''         # '' is the checkpoint's own, or the one it was trained with
settings = {k: v for k, v in globals().items() if isinstance(v, str) and k[0] != '_'}
ranges = {'ternary': ('tq2_0', 'tq1_0', 'q4_0', 'q8_0', 'f16'),
          'dtype': ('float32', 'float16', 'q8_0'), 'embedding': ('auto', 'q8_0', 'dtype')}
config = configure(settings, sys.argv[1:], ranges)
globals().update(config)
if bool(gguf) == bool(merge):
    sys.exit("error: name one output: --gguf=FILE (for llama.cpp) or --merge=DIR "
             "(a LoRA checkpoint's adapters merged into its fp base)")
try:  # never into a checkpoint, which it would damage, nor over anything there
    checkpoint.check_output(gguf or merge, 'gguf' if gguf else 'merge', made=bool(merge))
except ValueError as e:
    sys.exit(f"error: {e}")
if merge and os.path.lexists(merge) and not (os.path.isdir(merge) and not os.listdir(merge)):
    sys.exit(f"error: merge={merge!r} is already there; name a new folder for the merged model")
adapters_gguf = gguf.removesuffix('.gguf') + '-lora.gguf'  # a ternary base's adapters
for path in (gguf, adapters_gguf) if gguf else ():
    if os.path.isdir(path):
        sys.exit(f"error: {path!r} is a folder; name the file to write, such as model.gguf")

try:
    ckpt, model, tokenizer = checkpoint.load(ckpt, 'cpu', True, tokenizer)
    lora = read_config(ckpt)
except (OSError, ValueError, RuntimeError, KeyError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
if merge and not lora:
    sys.exit(f"error: --merge takes a LoRA checkpoint (with adapter_config.json); "
             f"{ckpt} is a whole model")
if merge and model.config.bitnet:
    sys.exit("error: LoRA adapters on a ternary base cannot be merged (W_q + B A is not "
             "ternary); --gguf writes them to a file of their own")
merge_lora(model)  # an fp base's adapters are folded into it; a ternary base keeps them

if merge:
    model.save_pretrained(merge)
    if os.path.exists(os.path.join(ckpt, 'tokenizer.json')):
        checkpoint.copy_tokenizer(os.path.join(ckpt, 'tokenizer.json'), merge)
    print(f"wrote {merge}: the base with its LoRA adapters merged")
    sys.exit()

try:
    vocab = gguf_vocab(get_tokenizer(tokenizer), model.config.vocab_size)
except (OSError, ValueError) as e:
    sys.exit(f"error: tokenizer {tokenizer!r}: {e}")
template = chat_template_text(ckpt)
if template is not None:
    vocab['tokenizer.chat_template'] = template
weights = base_state(model)  # a ternary base's adapters go to a file of their own
eight_bit = embedding == 'q8_0' or (embedding == 'auto' and model.config.bitnet)
try:
    save_gguf(gguf, weights, model.config, vocab, ternary, getattr(torch, dtype, dtype),
              'q8_0' if eight_bit else None)
except (OSError, ValueError) as e:
    sys.exit(f"error: cannot export {ckpt!r} to GGUF: {e}")
print(f"wrote {gguf}: {os.path.getsize(gguf) / 2**20:.1f} MiB")
if lora and model.config.bitnet:
    try:
        save_lora_gguf(adapters_gguf, adapter_state(model.layers), lora['lora_alpha'])
    except OSError as e:
        sys.exit(f"error: cannot write {adapters_gguf!r}: {e}")
    print(f"wrote {adapters_gguf}: the adapters "
          f"(llama-cli -m BASE.gguf --lora {os.path.basename(adapters_gguf)})")
