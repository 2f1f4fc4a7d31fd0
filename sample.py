"""
Generate text from a checkpoint:

    python sample.py                          # the latest checkpoint in out/
    python sample.py --ckpt=out/ckpt_0000750 --prompt="def " --num_tokens=200
    python sample.py --ckpt=out --export=model.gguf  # write it for llama.cpp instead
    python sample.py --ckpt=out-lora                 # a base model with LoRA adapters (train.py)

`ckpt` is a checkpoint directory written by train.py or any Hugging Face Llama/BitNet
directory; an out_dir picks its latest checkpoint. A ternary model runs packed (2-bit weights
and the int8 kernels of kernels.py) unless --packed=False. Prints the text, the decode speed
and the memory the weights take. --export=FILE writes the checkpoint as a GGUF file that
llama.cpp runs (a ternary model in its `bitnet` architecture: model.save_gguf), with the
tokenizer and, when the checkpoint has one, its chat template (data.gguf_vocab).

A LoRA checkpoint (PEFT's adapter files, as train.py writes them with lora_rank > 0) is loaded
onto the base model that its adapter_config.json names. On an fp base the adapters are merged
into the weights (W += alpha / r * B A), and --merge=DIR writes that as a plain checkpoint. On a
ternary base they stay beside the packed weights, since W_q + B A is no longer ternary, and
--export=M.gguf writes the base to M.gguf and the adapters to M-lora.gguf, the separate file
llama.cpp applies them from (llama-cli -m M.gguf --lora M-lora.gguf).
"""
import json
import os
import shutil
import sys
import time

import torch
from safetensors.torch import load_file

from bitlinear import add_lora, merge_lora
from configurator import configure
from data import chat_prompt, chat_template, get_tokenizer, gguf_vocab, resolve_model
from model import GGUF_NAMES, Transformer, write_gguf

ckpt = 'out'
prompt = 'The '
num_tokens = 200
temperature = 0.8      # 0: greedy
top_k = 50
chat = False           # the prompt is a user's message in the tokenizer's chat template; stop after the answer
seed = 1337
tokenizer = ''  # '' is the checkpoint's own: its tokenizer.json, or the one it was trained with
packed = True  # run ternary checkpoints on their 2-bit weights (False: fp latent weights, fake-quantized)
device = 'cuda' if torch.cuda.is_available() else 'cpu'
export = ''            # a path: write the checkpoint there as GGUF for llama.cpp instead of sampling
export_ternary = 'tq2_0'  # GGUF type of ternary matrices: 'tq2_0', 'tq1_0' (smaller, slower), 'q8_0', 'f16'
export_dtype = 'float32'  # of the GGUF's embedding (and head): 'float32' or 'float16'
merge = ''             # LoRA on an fp base: write the merged model there (a plain checkpoint) instead
config = configure({k: v for k, v in globals().items() if not k.startswith('_') and
                    isinstance(v, (int, float, str))}, sys.argv[1:])
globals().update(config)

if os.path.isdir(ckpt) and not {'config.json', 'adapter_config.json'} & set(os.listdir(ckpt)):
    found = sorted(n for n in os.listdir(ckpt) if n.startswith('ckpt_'))
    if not found:
        sys.exit(f"error: no checkpoint in {ckpt!r}; train one with python train.py or pass --ckpt=DIR")
    ckpt = os.path.join(ckpt, found[-1])
try:
    ckpt = resolve_model(ckpt)  # a hub id is fetched into the cache first
    lora = os.path.join(ckpt, 'adapter_config.json')
    lora = json.load(open(lora)) if os.path.exists(lora) else None  # a LoRA checkpoint: adapters alone
    model = Transformer.from_pretrained(lora['base_model_name_or_path'] if lora else ckpt).to(device).eval()
    if lora:  # PEFT's names are ours behind its prefix: base_model.model.model.layers.<N>...
        add_lora(model.layers, lora['r'], lora['lora_alpha'], lora['target_modules'])
        sd = load_file(os.path.join(ckpt, 'adapter_model.safetensors'))
        sd = {k.removeprefix('base_model.model.model.layers.'): v for k, v in sd.items()}
        wrong = model.layers.load_state_dict(sd, strict=False)
        if wrong.unexpected_keys or any('.lora_' in k for k in wrong.missing_keys):
            raise ValueError("its adapter_model.safetensors does not hold the adapters adapter_config.json names")
except (OSError, ValueError, RuntimeError, KeyError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
if packed and model.config.bitnet and not model.config.packed:
    model.freeze()
merge_lora(model)  # an fp base's adapters are folded into its weights; a ternary base keeps them
if lora and merge and model.config.bitnet:
    sys.exit("error: LoRA adapters on a ternary base cannot be merged (W_q + B A is not ternary); sample "
             "from the checkpoint, or --export it to GGUF (the adapters go to a file of their own)")
if merge and not lora:
    sys.exit(f"error: --merge takes a LoRA checkpoint (with adapter_config.json); {ckpt} is a whole model")
if merge:
    model.save_pretrained(merge)
    for extra in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
        if os.path.exists(os.path.join(ckpt, extra)):
            shutil.copy(os.path.join(ckpt, extra), merge)
    sys.exit(print(f"wrote {merge}: the base with its LoRA adapters merged"))
if model.config.packed:
    model.fuse()  # faster decode: q/k/v and gate/up fused, an int8 head (files stay as they are)
weights = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n.endswith(('weight', 'weight_scale'))}
weights |= model.head8.keywords if model.head8 else {}  # the int8 copy of the head
weight_mb = sum(t.nbytes for t in weights.values()) / 2**20
state_file = os.path.join(ckpt, 'train_state.pt')
if not tokenizer:
    tokenizer = ckpt if os.path.exists(os.path.join(ckpt, 'tokenizer.json')) else \
        torch.load(state_file, weights_only=True)['tokenizer'] if os.path.exists(state_file) else 'bytes'
try:
    enc = get_tokenizer(tokenizer)
    end = chat_template(enc)[2] if chat else ''  # the token that ends an answer (ChatML's <|im_end|>)
    ids = chat_prompt(enc, prompt) if chat else enc.encode_ordinary(prompt)
except (OSError, ValueError) as e:
    sys.exit(f"error: tokenizer {tokenizer!r}: {e}")

if export:
    jinja, tok_config = (os.path.join(ckpt, f) for f in ('chat_template.jinja', 'tokenizer_config.json'))
    template = open(jinja).read() if os.path.exists(jinja) else \
        json.load(open(tok_config)).get('chat_template') if os.path.exists(tok_config) else None
    try:
        vocab = gguf_vocab(enc, model.config.vocab_size)
        vocab.update({'tokenizer.chat_template': template} if isinstance(template, str) else {})
        adapters = lora and model.config.bitnet  # else merged into an fp base above
        base = Transformer.from_pretrained(lora['base_model_name_or_path']) if adapters else model
        base.save_gguf(export, vocab, export_ternary, getattr(torch, export_dtype, None))
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot export {ckpt!r} to GGUF: {e}")
    print(f"wrote {export}: {os.path.getsize(export) / 2**20:.1f} MiB")
    if adapters:  # llama.cpp's LoRA file: each A (r, in) and B (out, r) in fp32, named after its matrix
        tensors = [(f'blk.{i}.{GGUF_NAMES[p]}.weight.{ab.lower()}', 0, v.shape, v.numpy().tobytes())
                   for k, v in model.layers.state_dict().items() if '.lora_' in k
                   for i, _, p, ab, _ in [k.split('.')]]  # k: 0.self_attn.q_proj.lora_A.weight
        kv = {'general.architecture': 'bitnet', 'general.type': 'adapter', 'adapter.type': 'lora',
              'adapter.lora.alpha': float(lora['lora_alpha'])}  # llama.cpp adds (alpha / r) B A x, as we do
        write_gguf(export := export.removesuffix('.gguf') + '-lora.gguf', kv, tensors)
        print(f"wrote {export}: the adapters (llama-cli -m BASE.gguf --lora {os.path.basename(export)})")
    sys.exit()

torch.manual_seed(seed)
idx = torch.tensor([ids], device=device)
num_tokens = min(num_tokens, model.config.max_seq_len - idx.size(1))
with torch.no_grad():
    model(idx[:, :1])  # warm-up, so that a first-use kernel build is not timed
t0 = time.time()
out = model.generate(idx, num_tokens, temperature=temperature, top_k=top_k,
                     eos_id=enc.encode_single_token(end) if chat else None, vocab=enc.n_vocab)[0].tolist()
dt, num_tokens = time.time() - t0, len(out) - idx.size(1)
print(enc.decode(out[idx.size(1):] if chat else out).removesuffix(end))  # a chat prints just the answer
kind = 'packed ternary' if model.config.packed else 'ternary (fake-quantized)' if model.config.bitnet else 'fp'
print(f"--- {ckpt}: {kind}, weights {weight_mb:.1f} MiB, {num_tokens / dt:.1f} tokens/s")
