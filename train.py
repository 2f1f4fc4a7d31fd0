"""
Train a ternary (BitNet b1.58) Llama. With no arguments it trains a tiny model on the
offline corpus, on the CPU, in a few minutes:

    python train.py                                  # the tiny ternary default
    python train.py config/tiny_fp.py                # its full-precision twin
    python train.py --init_from=resume               # carry on from the last checkpoint
    torchrun --nproc_per_node=2 train.py             # DDP: gloo on CPU, nccl on CUDA

The script reads top to bottom like nanoGPT's: settings, DDP, data, model, optimizer, loop.
A checkpoint is a Hugging Face directory (transformers opens it) plus train_state.pt.
"""
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bitlinear import set_lambda
from configurator import configure
from data import get_batch, get_tokenizer, offline_corpus
from model import ModelConfig, Transformer
from objectives import OBJECTIVES, CurriculumScheduler, LocalTeacher, ObjectiveManager, RemoteTeacher, ce_loss

_imported = set(globals())  # everything defined below, up to the ruler, is a setting
# -----------------------------------------------------------------------------
# default settings: a tiny ternary model on the offline corpus, trained on the CPU
# I/O
out_dir = 'out'
init_from = 'scratch'  # 'scratch', 'resume' (the last checkpoint in out_dir), or an HF checkpoint dir
eval_interval = 50     # evaluate on val every this many optimizer steps (and at the end)
eval_iters = 20        # batches per evaluation
log_interval = 10
ckpt_interval = 0      # also checkpoint every this many steps; 0: only on val improvement and at the end
keep_last = 2          # complete checkpoints to keep, besides the best one
sample_tokens = 300    # printed at the end of training; 0 to skip
# data
tokenizer = 'bytes'
batch_size = 16        # sequences per rank per micro-step
block_size = 128
gradient_accumulation_steps = 1  # for the global batch; divided by the number of DDP ranks
# model (for init_from='scratch'; a checkpoint brings its own)
n_layer = 4
n_embd = 256
n_head = 4
n_kv_head = 4
intermediate_size = 688
act = 'silu'
rope_theta = 10000.0
tie_embeddings = True
bitnet = True          # ternary attention/MLP linears with SubLN; False gives the fp twin
lambda_warmup = 0      # optimizer steps over which quantization ramps from fp (0) to ternary (1)
lrc_rank = 0           # low-rank correction adapters on every BitLinear (0: none)
# objectives: name -> settings (see objectives.py), weighed by a curriculum of phases
# [(end as a fraction of max_steps, {name: weight}), ...], switched or blended ('linear', 'cosine')
objectives = {'ce': {}}
curriculum = [(1.0, {'ce': 1.0})]
blend = 'switch'
teacher = ''           # '' (none), a checkpoint / HF directory (local, frozen), or a vLLM URL http://...
teacher_model = ''     # the model name a vLLM teacher serves
teacher_top_k = 20     # logprobs per position from a vLLM teacher
# optimizer: AdamW, linear warmup then cosine decay to min_lr at max_steps
max_steps = 300
learning_rate = 3e-3   # BitNet trains best with a larger LR than its fp twin
min_lr = 3e-4
warmup_steps = 30
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0        # 0 disables clipping
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32'
compile = False
seed = 1337
peak_flops = 989e12    # for MFU: the accelerator's dense bf16 peak (H100 SXM)
# -----------------------------------------------------------------------------
config = configure({k: v for k, v in globals().items() if k not in _imported and not k.startswith('_')}, sys.argv[1:])
globals().update(config)

# DDP: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
ddp = 'RANK' in os.environ
rank, local_rank, world_size = 0, 0, 1
if ddp:
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    rank, local_rank, world_size = dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    if gradient_accumulation_steps % world_size:
        sys.exit(f"error: gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the {world_size} ranks")
    gradient_accumulation_steps //= world_size
master = rank == 0
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}.get(dtype)
if ptdtype is None:
    sys.exit(f"error: dtype={dtype!r} is not one of float32, bfloat16, float16")
ctx = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type, dtype=ptdtype)
torch.manual_seed(seed + rank)
tokens_per_step = gradient_accumulation_steps * world_size * batch_size * block_size
if master:
    os.makedirs(out_dir, exist_ok=True)
    print(f"tokens per optimizer step: {tokens_per_step:,} ({world_size} ranks)")

# data
enc = get_tokenizer(tokenizer)
train_data, val_data = offline_corpus(enc)


def batch(data, rng):
    x, y = get_batch(data, batch_size, block_size, rng)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def checkpoints(folder):
    """Complete checkpoints in a run's folder, oldest first. An interrupted save never gets a
    ckpt_ name: it is written under .tmp_ and renamed only once complete."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(os.path.join(folder, n) for n in names if n.startswith('ckpt_'))


def load(src):
    """A model from an HF directory, or from the latest checkpoint of a run's out_dir."""
    if not os.path.exists(os.path.join(src, 'config.json')) and checkpoints(src):
        src = checkpoints(src)[-1]
    try:
        return Transformer.from_pretrained(src), src
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"error: cannot load {src!r}: {e}")


# model: from scratch, from the last checkpoint, or from a Hugging Face directory
step, best_val, best_step, state = 0, float('inf'), 0, None
if init_from == 'scratch':
    model = Transformer(ModelConfig(
        vocab_size=64 * math.ceil(enc.n_vocab / 64), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_kv_head=n_kv_head, intermediate_size=intermediate_size, rope_theta=rope_theta, act=act,
        max_seq_len=block_size, tie_embeddings=tie_embeddings, bitnet=bitnet))
else:
    if init_from == 'resume' and not checkpoints(out_dir):
        sys.exit(f"error: no checkpoint in {out_dir!r} to resume from; train once first or set --out_dir")
    model, src = load(out_dir if init_from == 'resume' else init_from)
    if init_from == 'resume':
        state = torch.load(os.path.join(src, 'train_state.pt'), weights_only=True)
        step, best_val, best_step = state['step'], state['best_val'], state['best_step']
    if enc.n_vocab > model.config.vocab_size:
        sys.exit(f"error: tokenizer {tokenizer!r} has {enc.n_vocab} tokens but the model only {model.config.vocab_size}; use the model's tokenizer")
    if model.config.max_seq_len < block_size:
        sys.exit(f"error: block_size={block_size} exceeds the model's max_seq_len={model.config.max_seq_len}")
    if bitnet and not model.config.bitnet:
        model.to_bitnet()
if lrc_rank and not model.config.lrc_rank:
    model.add_lrc(lrc_rank)  # from the (converted) weights: the SVD of their quantization residual
model.to(device)
raw_model = model
if master:
    kind = 'ternary' if raw_model.config.bitnet else 'fp'
    print(f"{kind} model: {raw_model.num_params() / 1e6:.2f}M parameters, init_from={init_from}")

# objectives and the teacher they distil from
if teacher.startswith(('http://', 'https://')):
    teacher_net = RemoteTeacher(teacher, teacher_model, top_k=teacher_top_k)
elif teacher:
    teacher_net = LocalTeacher(load(teacher)[0], device, ptdtype)
    if teacher_net.model.config.vocab_size != raw_model.config.vocab_size:
        sys.exit(f"error: teacher vocab {teacher_net.model.config.vocab_size} != student vocab {raw_model.config.vocab_size}; both must share a tokenizer")
else:
    teacher_net = None
unknown = set(objectives) - set(OBJECTIVES)
if unknown:
    sys.exit(f"error: unknown objectives {sorted(unknown)}; choose from {sorted(OBJECTIVES)}")
if 'diffusion' in objectives:  # a dedicated mask token: the tokenizer's, or a spare embedding row
    if '<|mask|>' in enc.special_tokens_set:
        mask_id = enc.encode_single_token('<|mask|>')
    elif raw_model.config.vocab_size > enc.n_vocab:
        mask_id = enc.n_vocab  # a padding row of the embedding, which no text ever produces
    else:
        sys.exit("error: diffusion needs a mask token; the tokenizer has no <|mask|> and the embedding no spare row")
    objectives['diffusion'].setdefault('mask_id', mask_id)
try:
    manager = ObjectiveManager({n: OBJECTIVES[n](**kw) for n, kw in objectives.items()},
                               CurriculumScheduler(curriculum, blend), teacher_net, raw_model.config.n_layer)
except (TypeError, ValueError) as e:
    sys.exit(f"error: objectives/curriculum: {e}")

# optimizer: weight decay on matrices (linears, embeddings), none on norms and biases
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(
    [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
     {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}],
    lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
if state is not None:
    optimizer.load_state_dict(state['optimizer'])
    scaler.load_state_dict(state['scaler'])
    if master:
        print(f"resumed from {src} at step {step} (best val {best_val:.4f})")
if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)


def get_lr(step):
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    ratio = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def all_mean(x):
    if ddp:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x


@torch.no_grad()
def evaluate():
    """Mean val loss over eval_iters batches; the same batches at every evaluation."""
    model.eval()
    rng = torch.Generator().manual_seed(seed + rank)
    losses = torch.zeros(eval_iters, device=device)
    for i in range(eval_iters):
        x, y = batch(val_data, rng)
        with ctx:
            losses[i] = ce_loss(model(x), y)
    model.train()
    return all_mean(losses.mean()).item()  # a CPU-GPU sync


def save_checkpoint(step):
    """Write the HF directory and the training state under a temporary name, then rename:
    a crash mid-save leaves the earlier checkpoints as they were."""
    final, tmp = os.path.join(out_dir, f'ckpt_{step:07d}'), os.path.join(out_dir, f'.tmp_ckpt_{step:07d}')
    shutil.rmtree(tmp, ignore_errors=True)
    raw_model.save_pretrained(tmp)
    torch.save({'step': step, 'best_val': best_val, 'best_step': best_step, 'optimizer': optimizer.state_dict(),
                'scaler': scaler.state_dict(), 'config': config}, os.path.join(tmp, 'train_state.pt'))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    best = os.path.join(out_dir, f'ckpt_{best_step:07d}')
    for old in checkpoints(out_dir)[:-keep_last]:
        if old != best:
            shutil.rmtree(old)
    print(f"saved {final}")


# the training loop
start_step = step_last = step
rng = torch.Generator().manual_seed(seed + 1_000_003 * (rank + 1) + step)  # a fresh stream on resume
x, y = batch(train_data, rng)
t_start = t_last = time.time()
tokens_seen = step * tokens_per_step
log = open(os.path.join(out_dir, 'log.jsonl'), 'a') if master else None
while step < max_steps:
    lr = get_lr(step)
    for group in optimizer.param_groups:
        group['lr'] = lr
    if lambda_warmup:
        set_lambda(raw_model, min(1.0, step / lambda_warmup))
    loss_sum, metrics = torch.zeros((), device=device), {}
    for micro in range(gradient_accumulation_steps):
        if ddp:  # all-reduce the gradients only once, after the last micro-step
            model.require_backward_grad_sync = micro == gradient_accumulation_steps - 1
        with ctx:
            loss, parts = manager(model, {'x': x, 'y': y}, step / max_steps)
        x, y = batch(train_data, rng)  # fetch the next batch while the backward runs on GPU
        loss_sum += loss.detach()
        for k, v in parts.items():  # the mean over micro-steps, like the loss
            metrics[k] = metrics.get(k, 0.0) + v / gradient_accumulation_steps
        scaler.scale(loss / gradient_accumulation_steps).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf'))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    step += 1
    tokens_seen += tokens_per_step

    last = step == max_steps
    is_eval = step % eval_interval == 0 or last
    improved = False
    if step % log_interval == 0 or is_eval:
        train_loss = all_mean(loss_sum / gradient_accumulation_steps).item()  # a CPU-GPU sync
        now = time.time()
        tok_per_s = tokens_per_step * (step - step_last) / (now - t_last)
        rec = {'step': step, 'loss': train_loss, 'lr': lr, 'grad_norm': grad_norm.item(),
               'tokens': tokens_seen, 'tok_per_s': round(tok_per_s), 'time_s': round(now - t_start, 2)}
        rec.update({k: all_mean(v).item() if torch.is_tensor(v) else v for k, v in metrics.items()})
        if device_type == 'cuda':
            rec['mfu'] = raw_model.flops_per_token(block_size) * tok_per_s / (world_size * peak_flops)
        if is_eval:
            rec['val_loss'] = evaluate()
            improved = rec['val_loss'] < best_val
            if improved:
                best_val, best_step = rec['val_loss'], step
        if master:
            log.write(json.dumps(rec) + '\n')
            log.flush()
            eta = (now - t_start) / (step - start_step) * (max_steps - step)
            val = f" | val {rec['val_loss']:.4f}" if is_eval else ''
            print(f"step {step}/{max_steps} | loss {train_loss:.4f}{val} | lr {lr:.2e} | "
                  f"{tok_per_s / 1e3:.1f}k tok/s | eta {eta:.0f}s")
        t_last, step_last = time.time(), step
    if master and (improved or last or (ckpt_interval and step % ckpt_interval == 0)):
        save_checkpoint(step)

if master and sample_tokens:
    prompt = torch.tensor([enc.encode_ordinary('The ')], device=device)
    with ctx:
        n = min(sample_tokens, raw_model.config.max_seq_len - prompt.size(1))  # stay within trained positions
        out = raw_model.eval().generate(prompt, n, temperature=0.8, top_k=50, vocab=enc.n_vocab)
    print('-' * 40 + '\n' + enc.decode(out[0].tolist()) + '\n' + '-' * 40)
if ddp:
    dist.destroy_process_group()
