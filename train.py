"""
Train a ternary (BitNet b1.58) Llama. With no arguments it trains a tiny model on the
offline corpus, on the CPU, in a few minutes:

    python train.py                                  # the tiny ternary default
    python train.py config/tiny_fp.py                # its full-precision twin
    python train.py --init_from=resume               # carry on from the last checkpoint
    torchrun --nproc_per_node=2 train.py             # DDP: gloo on CPU, nccl on CUDA
    torchrun --nproc_per_node=2 train.py --fsdp=True # FSDP2: weights, grads, AdamW split
    python train.py config/lora.py                   # LoRA on a frozen, packed model
    python train.py config/smollm.py --check         # the settings resolved, then exit

The script reads top to bottom like nanoGPT's: settings, DDP, data, model, objectives,
auto batch, optimizer, the run's state (TrainState: all a checkpoint saves), the loop. The
set-up finishes every setting before anything takes it. The pieces live in the files it
imports (objectives.py: losses; optim.py: optimizers; data.py: batches; checkpoint.py:
checkpoints).
"""
import functools
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
from bitlinear import TARGETS, set_lambda
from configurator import configure
from data import Batches, offline_corpus, preference_pairs, setup_data
from engine import complete
from kernels import holding_weights
from eval import check_tasks, loss_sums, token_bytes, zero_shot
from report import Progress
from lora import attach_lora, load_adapters, save_adapters, set_adapters
from model import ModelConfig, Transformer
from objectives import ObjectiveManager, ce_loss, mask_token
from optim import (SCHEDULES, ZClip, check_fits, clip_gradients, drop_weight_decay, find_lr,
                   fit_batch, lr_factor, make_optimizers, optimizer_step, param_groups, remix,
                   reset_moments, saved_bytes, set_lr)
from remote import Uploader, download_latest
from rl import Rollouts
from teachers import BaseTeacher, LocalTeacher, RemoteTeacher
from tokenizer import eos_id, run_tokenizer

_imported = set(globals())  # everything defined below, up to the ruler, is a setting
# -----------------------------------------------------------------------------
# default settings: a tiny ternary model on the offline corpus, trained on the CPU
# I/O
out_dir = 'out'
# 'scratch', 'resume' (out_dir's last checkpoint), a run's folder, an HF dir or hub id,
# or a storage URL such as s3://bucket/run (its newest complete checkpoint, resumed)
init_from = 'scratch'
eval_interval = 125    # evaluate on val every this many optimizer steps (and at the end)
eval_iters = 20        # batches per evaluation
log_interval = 10
ckpt_interval = 0      # also save every this many steps (0: at improvements, the end)
keep_last = 2          # complete checkpoints to keep, besides the best one
upload_to = ''         # also upload each checkpoint here, in the background (remote.py)
patience = 0           # stop after this many evals without improvement (0: never)
min_delta = 0.0        # ... an improvement being a val loss lower by more than this
sample_tokens = 300    # printed at the end of training; 0 to skip
eval_prompts = []      # at every eval, the greedy continuations are logged ('samples')
eval_tasks = []        # ... and zero-shot accuracies (eval.py), e.g. ['arc_easy:200']
wandb_log = False
wandb_project = 'nanobitnet'
# data
# '' is the model's own (init_from's tokenizer.json), else 'bytes' (offline), a tiktoken
# name ('gpt2'), a tokenizer.json or its directory, or a hub model id
tokenizer = ''
dataset = ''           # a folder of token shards (data.py); '' is the offline corpus
data_files = {}        # {'train'/'val': [paths, URLs, hf:// files]}: made into dataset
data_format = 'text'   # 'text', 'jsonl', 'chat' (SFT), 'tokens' (llm.c shards)
text_field = 'text'    # jsonl: the field that holds the text
mixture = {}           # {name: (folder, weight)}: prepared folders (val: dataset's)
remix_interval = 0     # reweigh the mixture every this many steps (0: never)
remix_eta = 1.0
remix_floor = 0.05
dpo_data = ''          # a jsonl of {prompt, chosen, rejected} for the dpo objective
# GRPO (rl.py): a jsonl of prompts and the rewards' columns, or 'arithmetic' (offline);
# the model samples batch_size prompts x group per micro-step, every `iterations` steps
grpo_data = ''
grpo_heldout = ''      # scored greedily at every eval, e.g. 'arithmetic_heldout'
rollout = dict(group=8, max_new_tokens=128, temperature=1.0, top_p=1.0,
               rewards=['correct_answer'], scale_rewards='group', iterations=1)
batch_size = 16        # sequences per rank per micro-step
block_size = 128
gradient_accumulation_steps = 1  # for the global batch; divided by the DDP ranks
# model (for init_from='scratch'; a checkpoint brings its own)
n_layer = 4
n_embd = 256
n_head = 4
n_kv_head = 4
intermediate_size = 688
act = 'silu'
rope_theta = 10000.0
tie_embeddings = True
bitnet = True          # ternary attention/MLP linears with SubLN; False: the fp twin
lambda_warmup = 0.0    # fraction of max_steps over which quantization ramps from 0 to 1
subln_calib = 4        # converting a pretrained model: batches that calibrate SubLN
linear_norm = False    # an RMSNorm before every BitLinear too (BitDistill's)
weight_scale = 'matrix'  # ternary weights' gamma: one per 'matrix', per output 'row', or
                         # per row and 'block' of 256 inputs (widths multiples of 256)
lrc_rank = 0           # low-rank correction adapters on every BitLinear (0: none)
# mixture of experts (moe.py): n_experts > 0 makes every MLP one; a dense init_from is
# upcycled (its MLP copied into each expert). Router losses: objectives['router']
moe = dict(n_experts=0, top_k=2, n_shared_experts=0, norm_topk_prob=True,
           moe_intermediate_size=0)
lora_rank = 0          # LoRA: train adapters of this rank on a frozen init_from (0: off)
lora_alpha = 16.0      # the adapters' output is scaled by lora_alpha / lora_rank
lora_targets = ','.join(TARGETS)  # the linears (of each block) that get adapters
# objectives: name -> settings (see objectives.py), weighed by a curriculum of phases
# [(end as a fraction of max_steps, {name: weight}), ...], switched or blended
objectives = {'ce': {}}
curriculum = [(1.0, {'ce': 1.0})]
blend = 'switch'       # or 'linear', 'cosine'
phase_reset = True     # a step that trains other objectives than the last starts the
                       # optimizer's moments afresh and warms the LR up again over
                       # warmup_steps (the old phase's moments would size its steps)
teacher = ''           # '' (none), a checkpoint or HF dir, or a vLLM URL http://...
teacher_model = ''     # the model name a vLLM teacher serves
teacher_top_k = 20     # logprobs per position from a vLLM teacher
# optimizer: AdamW for everything, or Muon for the hidden matrices and AdamW for the rest
optimizer = 'adamw'    # 'adamw' or 'muon'
max_steps = 750        # optimizer steps; every schedule below is laid out over them
stop_after = 0         # end at this step, evaluated and saved, to resume later with
                       # the same schedules (training in chunks; 0: at max_steps)
learning_rate = 3e-3   # the hidden matrices' LR (--lr_find=True suggests one)
embed_lr = 0.0         # 0: same as learning_rate
head_lr = 0.0
scalar_lr = 0.0        # norms and biases
min_lr = 3e-4
schedule = 'cosine'    # after warmup: 'cosine', 'linear', 'constant', 'wsd', 'two_stage'
warmup_steps = 30
decay_frac = 0.2       # wsd: the final fraction of steps that decays to min_lr
weight_decay = 0.1     # two_stage: drops to 0 at the midpoint, with the LR
beta1 = 0.9
beta2 = 0.95
zero1 = False          # shard the optimizer state over the DDP ranks (ZeRO stage 1)
fsdp = False           # shard weights, gradients and optimizer state (FSDP2)
grad_clip = 1.0        # max grad norm (0: none); with zclip, its first 25 steps'
zclip = False          # adaptive clipping of grad-norm spikes by their z-score (ZClip)
zclip_z = 2.5
nan_patience = 5       # stop after this many non-finite steps in a row (each is skipped)
lr_find = False        # first run an LR range test, then train with the LR it suggests
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'float32'
if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
    dtype = 'bfloat16'
compile = False
grad_ckpt = False      # recompute each block's activations in backward: less memory
auto_batch = False     # the largest batch_size that fits, same global batch (CUDA; or
auto_batch_gib = 0.0   # ... with at most this many GiB kept for backward, any device)
seed = 1337
peak_flops = 989e12    # for MFU: the accelerator's dense bf16 peak (H100 SXM)
# -----------------------------------------------------------------------------
config = {k: v for k, v in globals().items() if k not in _imported and k[0] != '_'}
# the settings with a range, checked with the types before any work starts
ranges = {'eval_interval': 'positive', 'eval_iters': 'positive', 'log_interval': 'positive',
          'ckpt_interval': 'non-negative', 'keep_last': 'positive', 'patience': 'non-negative',
          'min_delta': 'non-negative', 'sample_tokens': 'non-negative',
          'data_format': ('text', 'jsonl', 'chat', 'tokens'), 'remix_interval': 'non-negative',
          'remix_eta': 'positive', 'remix_floor': 'fraction', 'batch_size': 'positive',
          'block_size': 'positive', 'gradient_accumulation_steps': 'positive',
          'n_layer': 'positive', 'n_embd': 'positive', 'n_head': 'positive',
          'n_kv_head': 'positive', 'intermediate_size': 'positive', 'act': ('silu', 'relu2'),
          'weight_scale': ('matrix', 'row', 'block'),
          'rope_theta': 'positive', 'lambda_warmup': 'fraction', 'subln_calib': 'positive',
          'lrc_rank': 'non-negative', 'lora_rank': 'non-negative', 'lora_alpha': 'positive',
          'blend': ('switch', 'linear', 'cosine'), 'teacher_top_k': 'positive',
          'optimizer': ('adamw', 'muon'), 'max_steps': 'positive', 'stop_after': 'non-negative',
          'learning_rate': 'positive', 'embed_lr': 'non-negative', 'head_lr': 'non-negative',
          'scalar_lr': 'non-negative', 'min_lr': 'non-negative', 'schedule': SCHEDULES,
          'warmup_steps': 'non-negative', 'decay_frac': 'fraction',
          'weight_decay': 'non-negative', 'beta1': 'fraction', 'beta2': 'fraction',
          'grad_clip': 'non-negative', 'zclip_z': 'positive', 'nan_patience': 'positive',
          'dtype': ('float32', 'bfloat16', 'float16'), 'peak_flops': 'positive',
          'auto_batch_gib': 'non-negative'}
# --check: the settings resolved and checked, printed (with their ranges) for sweeps
check = '--check' in sys.argv[1:]
config = configure(config, [a for a in sys.argv[1:] if a != '--check'], ranges)
if check:
    print(repr({'settings': config, 'ranges': ranges}))
    sys.exit()
globals().update(config)
try:  # zero-shot tasks are fetched (by one process a machine) and checked now
    if os.environ.get('LOCAL_RANK', '0') == '0':
        check_tasks(eval_tasks)
except (OSError, ValueError) as e:
    sys.exit(f"error: eval_tasks: {e}")
try:
    os.makedirs(out_dir, exist_ok=True)
except OSError as e:
    sys.exit(f"error: cannot make out_dir={out_dir!r} ({e.strerror}); set --out_dir to a "
             f"folder this run can write")
if not os.access(out_dir, os.W_OK):
    sys.exit(f"error: out_dir={out_dir!r} is not writable; set --out_dir to a folder this "
             f"run can write")

if device.startswith('cuda') and not torch.cuda.is_available():
    sys.exit(f"error: device={device!r}, but this torch sees no CUDA GPU; set --device=cpu")

# DDP: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE. The set-up below finishes the
# settings (each rank's GPU, its share of the accumulation steps, auto batch, the LR
# finder) before anything takes them; from the optimizers on, they are final.
ddp = 'RANK' in os.environ
rank, local_rank, world_size = 0, 0, 1  # a single process is rank 0 of 1
if ddp:
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ['LOCAL_RANK'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    if gradient_accumulation_steps % world_size:
        sys.exit(f"error: gradient_accumulation_steps={gradient_accumulation_steps} "
                 f"must be a multiple of the {world_size} ranks")
    gradient_accumulation_steps //= world_size  # the same global batch on any ranks
master = rank == 0  # logs, checkpoints and samples
cpu_compile = compile and device == 'cpu'
if fsdp and (not ddp or zero1 or lr_find or optimizer != 'adamw' or cpu_compile):
    sys.exit('error: fsdp=True runs under torchrun, with AdamW, and without zero1, '
             'lr_find or compile on CPU (Muon needs whole matrices); drop one of them')
if ddp and not fsdp and 'block' in objectives:  # DDP follows the logits' graph only
    sys.exit("error: objective 'block' runs on several ranks under fsdp=True only; add --fsdp=True")
targets = lora_targets.split(',')
unknown = set(targets) - set(TARGETS)
if lora_rank and (init_from == 'scratch' or fsdp or lambda_warmup or unknown):
    sys.exit(f"error: lora_rank={lora_rank} adapts a trained model: set init_from, "
             f"lora_targets among {','.join(TARGETS)}, and no fsdp or lambda_warmup")
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
ptdtype = getattr(torch, dtype)
ctx = nullcontext()
if ptdtype != torch.float32:
    ctx = torch.autocast(device_type, dtype=ptdtype)
if device_type == 'cuda':  # TF32 tensor cores for what stays fp32, as nanoGPT
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
torch.manual_seed(seed + rank)  # e.g. diffusion's masks (batches have seeds of their own)


def located(src):
    """The directory checkpoint.find gives for src, or the run ends in one line."""
    try:
        return checkpoint.find(src)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load {src!r}: {e}")


def load(src, found=False):
    """The model of checkpoint src (checkpoint.load: with its LoRA adapters, not packed;
    a directory that find or resume already verified is not verified again), or the run
    ends in one line."""
    try:
        if found:
            return checkpoint.open_found(src, packed=False)[1]
        return checkpoint.load(src, packed=False)[1]
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        sys.exit(f"error: cannot load {src!r}: {e}")


# the checkpoint we start from: a storage URL's newest complete one is downloaded to
# out_dir and resumed; a resume reads its training state (`saved`)
resume = init_from == 'resume' or '://' in init_from
if '://' in init_from:
    if local_rank == 0:
        download_latest(init_from, out_dir)
    if ddp:
        dist.barrier()
start = None  # the directory the run starts from
saved = None  # the training state of the checkpoint we resume
if resume:
    try:
        start, saved = checkpoint.resume(out_dir, master)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
elif init_from != 'scratch':
    start = located(init_from)
base = saved['base'] if saved and lora_rank else start  # LoRA checkpoints: adapters only
arch = ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'intermediate_size', 'act', 'bitnet')
# what a resumed run cannot change (a setting newer than its checkpoint: as now)
fixed = arch + ('moe', 'lrc_rank', 'lora_rank', 'lora_targets', 'tokenizer', 'optimizer',
               'zero1', 'linear_norm', 'weight_scale')
if saved:
    was = config | saved['config']
    changed = [f"{k}={was[k]!r} (now {config[k]!r})" for k in fixed if was[k] != config[k]]
    if changed:
        sys.exit(f"error: {start} was trained with {', '.join(changed)}; "
                 "resume with the same settings or a new out_dir")
    if len(saved['rng']) != world_size:
        sys.exit(f"error: {start} was trained on {len(saved['rng'])} ranks; "
                 "resume on as many")
first_step = saved['step'] if saved else 0
if stop_after and not first_step < stop_after < max_steps:
    sys.exit(f"error: stop_after={stop_after} must lie after step {first_step}, "
             f"below max_steps")
run_id = checkpoint.run_id(saved)  # kept across resumes: the run's upload URL is its own
uploader = Uploader(upload_to, run_id) if upload_to and master else None  # checked now

# data: the tokenizer (the model's own unless one is named, which must encode as it does;
# a resume keeps its own), then the offline corpus or token shards data.py prepares once
# (local rank 0). A resume sees the batches it would have seen (data.Batches).
try:
    own = checkpoint.tokenizer_of(start) if start and not saved else None
    enc, tokenizer_name, tokenizer_file = run_tokenizer(
        own, saved['tokenizer'] if saved else '', tokenizer)
    if (mixture and not dataset) or (remix_interval and not mixture):
        raise ValueError("mixture= needs dataset= (whose val split is evaluated); "
                         "remix_interval needs mixture=")
    if dataset:
        setup_data(dataset, data_files, tokenizer_name, data_format, text_field,
                   n_vocab=enc.n_vocab)
        train_data, val_data = mixture or dataset, dataset
    else:
        train_data, val_data = offline_corpus(enc)
    pairs = None
    if dpo_data:
        pairs = preference_pairs(dpo_data, enc, block_size, eos_id(enc))
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"error: data: {e}")


def batches_of(size):
    """The run's batches (data.Batches) at `size` sequences per micro-step."""
    return Batches(train_data, val_data, size, block_size, rank, world_size, seed, pairs,
                   device)


# model: from scratch, from the last checkpoint, or from a Hugging Face directory
if init_from != 'scratch':
    # a LoRA run's base is verified on resume as at its start (its checkpoint: already)
    model = load(base, found=base == start).train()
    if enc.n_vocab > model.config.vocab_size:
        sys.exit(f"error: tokenizer {tokenizer_name!r} has {enc.n_vocab} tokens but the "
                 f"model only {model.config.vocab_size}; use the model's tokenizer")
    if model.config.max_seq_len < block_size:
        sys.exit(f"error: block_size={block_size} exceeds "
                 f"max_seq_len={model.config.max_seq_len}")
try:  # model settings it cannot build are a one-line error
    if init_from == 'scratch':
        # the vocabulary padded to a multiple of 64 (faster matmuls, spare rows such as
        # diffusion's mask token); documents start with EOS, so it is also the BOS
        model = Transformer(ModelConfig(
            vocab_size=64 * math.ceil(enc.n_vocab / 64), max_seq_len=block_size,
            rope_theta=rope_theta, tie_embeddings=tie_embeddings,
            bos_token_id=eos_id(enc), eos_token_id=eos_id(enc), linear_norm=linear_norm,
            weight_scale=weight_scale, **{k: config[k] for k in arch}, **moe))
    elif moe.get('n_experts') and not model.config.n_experts:  # upcycling, before to_bitnet
        model.upcycle(**moe)
    check_fits(model.config, batch_size, block_size, device)  # before a batch is made
except (TypeError, ValueError) as e:
    sys.exit(f"error: model: {e}")
model.to(device)
if bitnet and not model.config.bitnet and not lora_rank:  # SubLN calibrated on batches
    calibration = batches_of(batch_size).calibration(subln_calib)
    model.to_bitnet(calibration, linear_norm, weight_scale)
if lrc_rank and not model.config.lrc_rank:
    model.add_lrc(lrc_rank)  # the SVD of the (converted) weights' quantization residual
if lora_rank:  # QLoRA: the base frozen (ternary: packed 2-bit), fp adapters
    model = attach_lora(model, lora_rank, lora_alpha, targets).to(device)
    if saved:  # the adapters, at their exact values
        load_adapters(model.layers, checkpoint.adapter_weights(start), start)
model.checkpoint_activations(grad_ckpt)
raw_model = model
if master:
    kind = 'ternary' if raw_model.config.bitnet else 'fp'
    trains = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
    print(f"{kind} model: {raw_model.num_params() / 1e6:.2f}M parameters, {trains:,} trained")

# objectives and the teacher they distil from
teacher_net = None
if teacher.startswith(('http://', 'https://')):
    teacher_net = RemoteTeacher(teacher, teacher_model, top_k=teacher_top_k,
                                vocab_size=raw_model.config.vocab_size)
elif teacher:
    teacher_net = LocalTeacher(load(teacher), device, ptdtype)
elif lora_rank:  # the base itself: the student, adapters off (DPO's, GRPO's reference)
    teacher_net = BaseTeacher(raw_model, set_adapters)
try:
    mask_id = None  # masked diffusion's: the tokenizer's, or a spare embedding row
    if 'diffusion' in objectives:
        mask_id = mask_token(enc, raw_model.config.vocab_size)
    manager = ObjectiveManager.from_settings(objectives, curriculum, blend, teacher_net,
                                             raw_model, mask_id)
except (TypeError, ValueError) as e:
    sys.exit(f"error: objectives: {e}")
rollouts = None
if grpo_data:  # the prompts, read once; under FSDP all ranks sample until all are done
    try:
        rollouts = Rollouts(grpo_data, grpo_heldout, enc, raw_model.config.max_seq_len,
                            seed, rank, world_size, sync=fsdp, **rollout)
    except (OSError, ValueError, TypeError) as e:
        sys.exit(f"error: grpo: {e}")

# auto batch: the largest micro-batch that fits, by trying one forward and backward of
# the run's own kind of batch; the same global batch, in more micro-steps
if auto_batch and device_type != 'cuda' and not auto_batch_gib:
    print("auto_batch: nothing to do on CPU (no memory limit to probe); "
          "set auto_batch_gib")
elif auto_batch:
    kept = {}  # GiB a micro-step of b sequences keeps for backward

    def try_batch(b):
        """One micro-step of b sequences (GRPO: b prompts' completions); a memory error
        when it does not fit."""
        batch = rollouts.probe(b, device) if rollouts else batches_of(b).get(0, 0)

        def micro_step():
            with ctx:
                manager(raw_model, batch, 1.0)[0].backward()
        kept[b] = saved_bytes(micro_step) / 2**30
        raw_model.zero_grad(set_to_none=True)
        if auto_batch_gib and kept[b] > auto_batch_gib:
            raise torch.OutOfMemoryError(f"{kept[b]:.4f} GiB kept for backward")
    batch_size, gradient_accumulation_steps = fit_batch(
        try_batch, batch_size, gradient_accumulation_steps, device)
    if master:
        print(f"auto_batch: batch_size={batch_size} x {gradient_accumulation_steps} "
              f"accumulation steps ({kept.get(batch_size, 0):.6f} GiB kept for backward)")
batches = batches_of(batch_size)

if fsdp:  # each block gathered for its forward and backward, then freed (fp32 on CPU)
    # imported here, not at the top: it takes seconds, which every run would pay
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    for v in raw_model.state_dict().values():  # rank 0's weights everywhere, as DDP does
        dist.broadcast(v, 0)
    policy = MixedPrecisionPolicy()  # fp32 on the CPU
    if device_type == 'cuda':  # compute in ptdtype, reduce gradients in fp32
        policy = MixedPrecisionPolicy(ptdtype, torch.float32)
    for block in raw_model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(raw_model, mp_policy=policy)
if compile:
    model = torch.compile(model)
if ddp and not fsdp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)  # fp16


def all_mean(x):
    """The mean of x over the ranks (a no-op alone): every rank logs the same."""
    if ddp:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x


def micro_steps(step, b):
    """Forward and backward over the step's micro-batches; the mean loss and metrics."""
    # the logged loss is the mean over all micro-steps, not the last one's
    loss_sum, metrics = torch.zeros((), device=device), {}
    samples = [{}] * gradient_accumulation_steps
    if rollouts:  # GRPO: the step's completions, sampled by the model as it is now
        samples, metrics = rollouts.step(raw_model, step, batch_size,
                                         gradient_accumulation_steps)
    for micro in range(gradient_accumulation_steps):
        b = b | samples[micro]
        last = micro == gradient_accumulation_steps - 1
        sync = nullcontext()  # DDP: all-reduce (FSDP: reduce-scatter) after the last only
        if fsdp:
            raw_model.set_requires_gradient_sync(last)
        elif ddp and not last:
            sync = model.no_sync()
        with sync:
            with ctx:
                loss, parts = manager(model, b, step / max_steps)
            if not last:  # the next batch while the GPU works
                b = batches.get(step, micro + 1)
            loss_sum += loss.detach()
            for k, v in parts.items():  # the mean over micro-steps, like the loss
                metrics[k] = metrics.get(k, 0.0) + v / gradient_accumulation_steps
            # the gradients add up to those of the mean loss
            scaler.scale(loss / gradient_accumulation_steps).backward()
    return loss_sum / gradient_accumulation_steps, metrics


def new_optimizers(lr):
    """AdamW, or Muon on the hidden matrices, each group at its own base LR (the hidden
    matrices' at lr)."""
    groups = param_groups(raw_model, lr, weight_decay, embed_lr, head_lr, scalar_lr)
    return make_optimizers(groups, optimizer, lr, (beta1, beta2), zero1 and ddp)


if lr_find and resume:  # the LR the range test found when the run began (saved below)
    learning_rate, min_lr = saved['config']['learning_rate'], saved['config']['min_lr']
elif lr_find:  # throwaway optimizers; the model is put back afterwards
    probe = new_optimizers(learning_rate)

    def lr_probe(i, lr):
        """One optimizer step at LR lr on step i's batches; its loss."""
        set_lr(probe, lr / learning_rate)
        loss, _ = micro_steps(0, batches.get(i, 0))
        optimizer_step(probe, scaler)
        return all_mean(loss).item()
    found = find_lr(lr_probe, out_dir, raw_model, verbose=master)
    min_lr = min_lr * found / learning_rate
    learning_rate = found
    config |= dict(learning_rate=learning_rate, min_lr=min_lr)  # saved with the settings


# everything a checkpoint saves and a resume restores, in one object
@dataclass
class TrainState:
    """Everything a checkpoint saves and a resume restores, in one object: the objects
    whose state travels with a run (the model, its optimizers, the fp16 gradient scaler,
    ZClip, the token shards' loader, GRPO's rollouts), what the run is (its settings,
    tokenizer, base model, id, code commit) and where it stands (step, the best val loss
    and its step, evals since an improvement). Built once, after the set-up; the loop
    moves it on, save_checkpoint writes it."""
    model: torch.nn.Module
    optimizers: list
    scaler: torch.amp.GradScaler
    zclip: object = None     # optim.ZClip, or None
    loader: object = None    # data.Loader, or None (the offline corpus: no position)
    rollouts: object = None  # rl.Rollouts, or None
    config: dict = field(default_factory=dict)
    tokenizer: str = 'bytes'
    base: str = None         # a LoRA run's frozen base model
    run_id: str = ''
    commit: str = ''
    step: int = 0
    best_val: float = math.inf
    best_step: int = 0
    bad_evals: int = 0

    def rank_state(self, device_type, data_state):
        """What each rank keeps of its own: its RNG, its data position (`data_state`,
        the loader's as it was before the step's next batch was drawn), its rollouts."""
        mine = checkpoint.rng_state(device_type) | {'data': data_state}
        if self.rollouts:
            mine['rollouts'] = self.rollouts.state_dict()
        return mine

    def state_dict(self, optimizers, ranks):
        """train_state.pt's content: the whole optimizer state (optimizer_states) and
        every rank's rank_state, as rank 0 gathered them."""
        return dict(step=self.step, best_val=self.best_val, best_step=self.best_step,
                    bad_evals=self.bad_evals, base=self.base, optimizers=optimizers,
                    scaler=self.scaler.state_dict(), rng=ranks, config=self.config,
                    commit=self.commit, tokenizer=self.tokenizer, run_id=self.run_id,
                    zclip=self.zclip.state_dict() if self.zclip else None)

    def restore(self, saved, rank, device_type, fsdp=False):
        """A resumed checkpoint's state (train_state.pt) back into place, on this rank:
        the optimizers, scaler and ZClip, this rank's RNG, data position and rollouts,
        and where the run stood."""
        optimizers = saved['optimizers']
        checkpoint.load_optimizer_states(self.model, self.optimizers, optimizers, fsdp)
        self.scaler.load_state_dict(saved['scaler'])
        if self.zclip:
            self.zclip.load_state_dict(saved['zclip'])
        mine = saved['rng'][rank]
        checkpoint.set_rng_state(mine, device_type)  # e.g. the masks of masked diffusion
        if self.rollouts:  # GRPO's completions, when a resume falls between two samplings
            self.rollouts.load_state_dict(mine['rollouts'])
        if self.loader:
            self.loader.load_state_dict(mine['data'])
        self.step, self.best_val = saved['step'], saved['best_val']
        self.best_step, self.bad_evals = saved['best_step'], saved['bad_evals']


run = TrainState(
    raw_model, new_optimizers(learning_rate), scaler,
    ZClip(zclip_z, max_norm=grad_clip) if zclip else None, batches.loader, rollouts,
    config, tokenizer_name, base, run_id, checkpoint.git_commit())
if saved:
    run.restore(saved, rank, device_type, fsdp)
    if master:
        print(f"resumed from {start} at step {run.step}: weights, optimizer, schedule, "
              f"RNG and data position restored (best val {run.best_val:.4f} at step "
              f"{run.best_step})")
val_bytes = token_bytes(enc, raw_model.config.vocab_size).to(device)  # each token's bytes


def evaluate():
    """The val loss per counted target and in bits per byte, on the same eval_iters
    batches every time (there is no dropout, so no model.eval())."""
    delay = 2 if master else math.inf  # only rank 0 shows progress
    show = Progress('evaluate', eval_iters, ' batches', 1, delay=delay)
    sums = loss_sums(model, batches.val_batches(eval_iters), val_bytes, ctx, show)
    loss, counted, nbytes = all_mean(sums).tolist()  # a CPU-GPU sync
    if not counted:
        sys.exit("error: no val batch holds a counted target; raise eval_iters")
    return loss / counted, loss / math.log(2) / max(nbytes, 1)


def batch_ce(m, b):
    """A batch's CE loss: remixing compares the sources' gradients with val's."""
    with ctx:
        return ce_loss(m(b['x'].to(device)), b['y'].to(device))


def save_checkpoint(run, data_state):
    """Rank 0 gathers every rank's RNG state and data position (and the shards of FSDP
    and ZeRO-1), then writes the checkpoint (checkpoint.save: atomic, with a manifest);
    every rank stops if that fails."""
    mine = run.rank_state(device_type, data_state)
    ranks = [mine] * world_size
    if ddp:
        dist.all_gather_object(ranks, mine)
    weights = checkpoint.model_state(run.model, fsdp)
    opts = checkpoint.optimizer_states(run.model, run.optimizers, fsdp, zero1 and ddp,
                                       master)
    failed = [None]
    if master:
        # the Hugging Face directory; with LoRA, the adapters alone (PEFT's layout)
        write = functools.partial(run.model.save_pretrained, state_dict=weights)
        if lora_rank:
            write = functools.partial(save_adapters, run.model.layers, rank=lora_rank,
                                      alpha=lora_alpha, targets=targets, base=run.base)
        failed[0] = checkpoint.save(out_dir, run.step, write, run.state_dict(opts, ranks),
                                    tokenizer_file, keep_last, run.best_step)
        if uploader and not failed[0]:
            uploader.submit(out_dir, run.step, run.best_step)
    if ddp:  # every rank learns whether rank 0 failed: none waits in a collective
        dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        if ddp:
            dist.destroy_process_group()
        sys.exit(f"error: {failed[0]}" if master else 1)


def new_phase(s):
    """Whether step s trains other objectives than step s - 1: known from the step alone,
    so a resumed chunk does at a switch what a straight run does."""
    return s > 0 and manager.active(s / max_steps) != manager.active((s - 1) / max_steps)


# the training loop
wandb = None
if wandb_log and master:
    try:
        import wandb
    except ImportError:
        sys.exit("error: wandb_log=True needs wandb: pip install wandb")
    wandb.init(project=wandb_project, config=config)
tokens_per_step = gradient_accumulation_steps * world_size * batch_size * block_size
log_path = os.path.join(out_dir, 'log.jsonl')
if master and saved:
    checkpoint.truncate_log(log_path, run.step)
log = open(log_path, 'a') if master else None
if master:
    print(f"tokens per optimizer step: {tokens_per_step:,} ({world_size} ranks); "
          f"commit {run.commit[:10] or 'unknown'}")
start_step = step_last = run.step
t_start = t_last = time.time()
tokens_seen, nan_run = run.step * tokens_per_step, 0
data_state = batches.loader.state_dict() if batches.loader else None
b = batches.get(run.step, 0)
while run.step < (stop_after or max_steps):
    step = run.step
    floor = min_lr / learning_rate
    factor = lr_factor(step, max_steps, warmup_steps, schedule, floor, decay_frac)
    rewarm = range(warmup_steps) if phase_reset else ()
    since = next((k for k in rewarm if new_phase(step - k)), None)
    if since is not None:  # the steps since the curriculum's last switch, warming up
        factor *= (since + 1) / warmup_steps
    lrs = set_lr(run.optimizers, factor)
    if schedule == 'two_stage' and step >= max_steps // 2:  # BitNet b1.58's second stage
        drop_weight_decay(run.optimizers)
    if lambda_warmup:
        set_lambda(raw_model, min(1.0, step / (lambda_warmup * max_steps)))
    if phase_reset and new_phase(step):
        reset_moments(run.optimizers)
    # the weights hold still until the optimizer steps: kernels.py quantizes each one once
    # for all micro-steps (and reuses an input's codes), and forgets it all at the end
    with holding_weights():
        train_loss, metrics = micro_steps(step, b)
    grad_norm, zclipped = clip_gradients(model, run.optimizers, scaler, grad_clip, run.zclip)
    skipped = not math.isfinite(grad_norm.item())
    # a NaN/Inf loss or gradient (fp16 overflow, a bad batch): skip the step, or stop
    nan_run = nan_run + 1 if skipped else 0
    if nan_run >= nan_patience:
        sys.exit(f"error: {nan_run} non-finite steps in a row at step {step}; "
                 "lower the learning rate or check the data")
    optimizer_step(run.optimizers, scaler, skipped)
    run.step = step = step + 1
    tokens_seen += tokens_per_step
    mix = {}
    if remix_interval and step % remix_interval == 0:  # before the next batch is drawn
        mix = remix(model, batch_ce, batches.loader, batches.val_batches(2), remix_eta, remix_floor)
    if batches.loader:  # where the next step reads
        data_state = batches.loader.state_dict()
    b = batches.get(step, 0)
    last = step in (max_steps, stop_after)  # of the run, or of its chunk

    # evaluate: the val loss (and samples), the best one so far, early stopping
    rec, improved, stop = {}, False, False
    if step % eval_interval == 0 or last:
        with holding_weights():  # as in the micro-steps
            rec['val_loss'], rec['val_bpb'] = evaluate()
            if eval_prompts and (master or fsdp):  # under FSDP every rank runs each forward
                with ctx:  # greedy continuations, read beside the losses
                    rec['samples'] = complete(raw_model, enc, eval_prompts, 48)
            if grpo_heldout and (master or fsdp):  # each reward's mean, greedy completions
                rec.update(rollouts.heldout_scores(raw_model))
            if eval_tasks and (master or fsdp):  # {task: {'acc', 'acc_norm', ...}}
                with ctx:
                    rec['zero_shot'] = zero_shot(raw_model, enc, eval_tasks,
                                                 raw_model.config.max_seq_len, device=device)
        improved = rec['val_loss'] < run.best_val - min_delta
        if improved:
            run.best_val, run.best_step, run.bad_evals = rec['val_loss'], step, 0
        else:
            run.bad_evals += 1
            stop = rec['early_stop'] = bool(patience) and run.bad_evals >= patience

    # log: one JSON line per logged step, and a line on the console
    if step % log_interval == 0 or rec or skipped or zclipped or mix:
        now = time.time()
        tok_per_s = tokens_per_step * (step - step_last) / (now - t_last)
        loss = all_mean(train_loss).item()
        rec.update(step=step, loss=loss, grad_norm=grad_norm.item(), **lrs,
                   tokens=tokens_seen, tok_per_s=round(tok_per_s),
                   time_s=round(now - t_start, 2))
        for k, v in metrics.items():
            rec[k] = all_mean(v).item() if torch.is_tensor(v) else v
        rec.update(mix)
        if nan_run:  # the length of a run of non-finite steps
            rec['skipped'] = nan_run
        if zclipped:  # the norm ZClip clipped a spike to
            rec['zclip'] = zclipped
        if device_type == 'cuda':
            flops = raw_model.flops_per_token(block_size) * tok_per_s / world_size
            rec['mfu'] = flops / peak_flops
            rec['peak_mem_gib'] = torch.cuda.max_memory_allocated() / 2**30
        if master:
            log.write(json.dumps(rec) + '\n')
            log.flush()
            if wandb:
                wandb.log(rec, step=step)
            eta = (now - t_start) / (step - start_step) * (max_steps - step)
            val = f" | val {rec['val_loss']:.4f}" if 'val_loss' in rec else ''
            flag = ' | skipped (non-finite)' if skipped else ''
            print(f"step {step}/{max_steps} | loss {rec['loss']:.4f}{val} | "
                  f"lr {lrs['lr_hidden']:.2e} | {tok_per_s / 1e3:.1f}k tok/s | "
                  f"eta {eta:.0f}s{flag}")
        t_last, step_last = time.time(), step

    # checkpoint: on a better val loss, at the end, at an early stop, every ckpt_interval
    if improved or last or stop or (ckpt_interval and step % ckpt_interval == 0):
        save_checkpoint(run, data_state)
    if stop:
        if master:
            print(f"early stop: no val improvement above {min_delta} in {patience} "
                  f"evals (best {run.best_val:.4f} at step {run.best_step})")
        break

if (master or fsdp) and sample_tokens:
    # at temperature 0.6 the tiny default model writes mostly real words (0.8: made up)
    with ctx:
        text = 'The ' + complete(raw_model, enc, ['The '], sample_tokens, 0.6, 50)[0]
    if master:
        print('-' * 40 + '\n' + text + '\n' + '-' * 40)
if uploader:
    uploader.close()  # waits for the last upload
if ddp:
    dist.destroy_process_group()
    time.sleep(0.2)  # gloo's threads free the last tensors under the GIL; exiting at once aborts
