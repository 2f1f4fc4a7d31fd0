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

The script reads top to bottom like nanoGPT's: settings, the set-up (ranks, the checkpoint
it starts from, data, model, objectives, auto batch, optimizers, the run's state), the loop.
The set-up finishes every setting before anything takes it; each optional feature is set
up in a line or two by the file that owns it (objectives.py: losses; optim.py: optimizers,
DDP and FSDP2; data.py: batches; checkpoint.py: checkpoints; run_state.py: the folder
the run owns, where it starts and run_state.TrainState, all a checkpoint saves; lora.py,
rl.py, teachers.py). A setting that only one feature reads
sits in that feature's group (a dict such as `arch` or `lora`), set one key at a time with
--group.key=value (configurator.py).
"""
import functools
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import checkpoint
import run_state
import teachers
from bitlinear import TARGETS, set_lambda
from configurator import configure, one_line
from data import Batches, run_data
from engine import complete
from eval import check_tasks, choice_texts_named, token_bytes, val_loss, zero_shot
from hub import settings_shown
from kernels import holding_weights
from lora import check_lora, set_adapters, setup_lora
from model import ModelConfig, Transformer
from objectives import ObjectiveManager, ce_loss, mask_token
from optim import (SCHEDULES, ZClip, check_fits, check_sharding, clip_gradients,
                   distribute, drop_weight_decay, find_lr, join_ranks, largest_batch,
                   lr_factor, make_optimizers, optimizer_step, param_groups, rank_mean,
                   remix_mixture, reset_moments, set_lr)
from remote import Uploader, download_latest
from report import start_wandb
from rl import Rollouts, task_file
from run_state import TrainState
from tokenizer import eos_id, run_tokenizer

# the flat names that the groups of settings replaced: an old command line or config file
# fails in one line that names the new spelling (configurator)
RENAMED = {'ckpt_interval': 'ckpt.interval', 'keep_last': 'ckpt.keep_last',
           'patience': 'early_stop.patience', 'min_delta': 'early_stop.min_delta',
           'sample_tokens': 'sample.tokens', 'eval_prompts': 'sample.prompts',
           'wandb_log': 'wandb_project', 'data_files': 'prepare.files',
           'data_format': 'prepare.format', 'text_field': 'prepare.text_field',
           'remix_interval': 'remix.interval', 'remix_eta': 'remix.eta',
           'remix_floor': 'remix.floor', 'grpo_data': 'grpo.data',
           'grpo_heldout': 'grpo.heldout', 'rollout': 'grpo', 'n_layer': 'arch.n_layer',
           'n_embd': 'arch.n_embd', 'n_head': 'arch.n_head',
           'n_kv_head': 'arch.n_kv_head',
           'intermediate_size': 'arch.intermediate_size', 'act': 'arch.act',
           'rope_theta': 'arch.rope_theta', 'tie_embeddings': 'arch.tie_embeddings',
           'lora_rank': 'lora.rank', 'lora_alpha': 'lora.alpha',
           'lora_targets': 'lora.targets',
           'teacher_model': 'vllm.model', 'teacher_top_k': 'vllm.top_k',
           'embed_lr': 'group_lr.embed', 'head_lr': 'group_lr.head',
           'scalar_lr': 'group_lr.scalar', 'beta1': 'adamw.beta1',
           'beta2': 'adamw.beta2',
           'zclip_z': 'zclip', 'auto_batch_gib': 'auto_batch.gib'}
# the settings a resumed run cannot change (run_state.check_start)
FIXED = ('arch', 'bitnet', 'moe', 'lrc_rank', 'lora', 'tokenizer', 'optimizer', 'zero1',
         'linear_norm', 'weight_scale')
# the settings with a range (a group: its keys' ranges), checked with the types before
# any work starts: those whose owner checks them only once the data and the model are set
# up (ModelConfig: act, weight_scale; optim: optimizer, schedule; objectives: blend; rl:
# grpo.group; data: prepare.format), or never
ranges = {'eval_interval': 'positive', 'eval_iters': 'positive', 'log_interval': 'positive',
          'ckpt': {'interval': 'non-negative', 'keep_last': 'positive'},
          'early_stop': {'patience': 'non-negative', 'min_delta': 'non-negative'},
          'sample': {'tokens': 'non-negative'},
          'prepare': {'format': ('text', 'jsonl', 'chat', 'tokens')},
          'remix': {'interval': 'non-negative', 'eta': 'positive', 'floor': 'fraction'},
          'grpo': {'group': 'positive'}, 'batch_size': 'positive', 'block_size': 'positive',
          'gradient_accumulation_steps': 'positive',
          'arch': {'n_layer': 'positive', 'n_embd': 'positive', 'n_head': 'positive',
                   'n_kv_head': 'positive', 'intermediate_size': 'positive',
                   'act': ('silu', 'relu2'), 'rope_theta': 'positive'},
          'weight_scale': ('matrix', 'row', 'block'), 'lambda_warmup': 'fraction',
          'subln_calib': 'non-negative', 'lrc_rank': 'non-negative', 'moe': {},
          'lora': {'rank': 'non-negative', 'alpha': 'positive'},
          'blend': ('switch', 'linear', 'cosine'), 'vllm': {'top_k': 'positive'},
          'optimizer': ('adamw', 'muon'), 'max_steps': 'positive',
          'stop_after': 'non-negative', 'learning_rate': 'positive',
          'group_lr': {'embed': 'non-negative', 'head': 'non-negative',
                       'scalar': 'non-negative'},
          'min_lr': 'non-negative', 'schedule': SCHEDULES, 'warmup_steps': 'non-negative',
          'decay_frac': 'fraction', 'weight_decay': 'non-negative',
          'adamw': {'beta1': 'fraction', 'beta2': 'fraction'}, 'grad_clip': 'non-negative',
          'zclip': 'non-negative', 'nan_patience': 'positive',
          'dtype': ('float32', 'bfloat16', 'float16'), 'auto_batch': {'gib': 'non-negative'},
          'peak_flops': 'positive'}
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
# save at every improvement and at the end, and every `interval` steps (0: not), keeping
# the `keep_last` newest complete checkpoints besides the best one
ckpt = dict(interval=0, keep_last=2)
upload_to = ''         # also upload each checkpoint here, in the background (remote.py)
# stop after `patience` evals without an improvement (0: never), an improvement being a
# val loss lower by more than min_delta
early_stop = dict(patience=0, min_delta=0.0)
# greedy continuations of `prompts` logged at every eval ('samples'); `tokens` printed at
# the end of training (0: none)
sample = dict(prompts=[], tokens=300)
eval_tasks = []        # zero-shot accuracies (eval.py) at every eval, e.g. ['arc_easy:200']
wandb_project = ''     # also log to this Weights & Biases project ('': not)
# data
# '' is the model's own (init_from's tokenizer.json), else 'bytes' (offline), a tiktoken
# name ('gpt2'), a tokenizer.json or its directory (a checkpoint; a run's folder: its
# newest checkpoint's), or a hub model id
tokenizer = ''
dataset = ''           # a folder of token shards (data.py); '' is the offline corpus
# what dataset is made from when it is not there yet: {'train'/'val': [paths, URLs, hf://
# files, offline tasks' files by name: 'arithmetic_sft_train' (rl.task_file),
# 'arc_easy-test_rc_5shot-choices' (eval.choice_texts_named)]} in a format ('text',
# 'jsonl', 'chat' for SFT, 'tokens' for llm.c shards)
prepare = dict(files={}, format='text', text_field='text')
mixture = {}           # {name: (folder, weight)}: prepared folders (val: dataset's)
remix = dict(interval=0, eta=1.0, floor=0.05)  # reweigh the mixture every interval steps
dpo_data = ''          # a jsonl of {prompt, chosen, rejected} for the dpo objective
# GRPO and on-policy distillation (rl.py): `data` is a jsonl of prompts and the rewards'
# columns, or an offline task's ('arithmetic_train'), `heldout` is scored greedily at every
# eval; the model samples batch_size prompts x group per micro-step, every `iterations` steps
grpo = dict(data='', heldout='', group=8, max_new_tokens=128, temperature=1.0, top_p=1.0,
            rewards=['correct_answer'], scale_rewards='group', iterations=1)
batch_size = 16        # sequences per rank per micro-step
block_size = 128
gradient_accumulation_steps = 1  # for the global batch; divided by the DDP ranks
# model (for init_from='scratch'; a checkpoint brings its own)
arch = dict(n_layer=4, n_embd=256, n_head=4, n_kv_head=4, intermediate_size=688, act='silu',
            rope_theta=10000.0, tie_embeddings=True)
bitnet = True          # ternary attention/MLP linears with SubLN; False: the fp twin
lambda_warmup = 0.0    # fraction of max_steps over which quantization ramps from 0 to 1
subln_calib = 4        # converting a pretrained model: batches that calibrate SubLN (0: gain 1)
linear_norm = False    # an RMSNorm before every BitLinear too (BitDistill's)
weight_scale = 'matrix'  # ternary weights' gamma: one per 'matrix', per output 'row', or
                         # per row and 'block' of 256 inputs (widths multiples of 256)
lrc_rank = 0           # low-rank correction adapters on every BitLinear (0: none)
# mixture of experts (moe.py): n_experts > 0 makes every MLP one; a dense init_from is
# upcycled (its MLP copied into each expert). Router losses: objectives['router']
moe = dict(n_experts=0, top_k=2, n_shared_experts=0, norm_topk_prob=True,
           moe_intermediate_size=0)
# LoRA: train adapters of this rank on a frozen init_from (0: off) on these linears of
# each block, their output scaled by alpha / rank
lora = dict(rank=0, alpha=16.0, targets=','.join(TARGETS))
# objectives: name -> settings (see objectives.py), weighed by a curriculum of phases
# [(end as a fraction of max_steps, {name: weight}), ...], switched or blended
objectives = {'ce': {}}
curriculum = [(1.0, {'ce': 1.0})]
blend = 'switch'       # or 'linear', 'cosine'
phase_reset = True     # a step that trains other objectives than the last starts the
                       # optimizer's moments afresh and warms the LR up again over
                       # warmup_steps (the old phase's moments would size its steps)
teacher = ''           # '' (none), a checkpoint or HF dir, or a vLLM URL http://...
vllm = dict(model='', top_k=20)  # a vLLM teacher: the model it serves, logprobs per position
# optimizer: AdamW for everything, or Muon for the hidden matrices and AdamW for the rest
optimizer = 'adamw'    # 'adamw' or 'muon'
max_steps = 750        # optimizer steps; every schedule below is laid out over them
stop_after = 0         # end at this step, evaluated and saved, to resume later with
                       # the same schedules (training in chunks; 0: at max_steps)
learning_rate = 3e-3   # the hidden matrices' LR (--lr_find=True suggests one)
group_lr = dict(embed=0.0, head=0.0, scalar=0.0)  # the other groups' (0: learning_rate);
                                                  # scalar: norms and biases
min_lr = 3e-4
schedule = 'cosine'    # after warmup: 'cosine', 'linear', 'constant', 'wsd', 'two_stage'
warmup_steps = 30
decay_frac = 0.2       # wsd: the final fraction of steps that decays to min_lr
weight_decay = 0.1     # two_stage: drops to 0 at the midpoint, with the LR
adamw = dict(beta1=0.9, beta2=0.95)
zero1 = False          # shard the optimizer state over the DDP ranks (ZeRO stage 1)
fsdp = False           # shard weights, gradients and optimizer state (FSDP2)
grad_clip = 1.0        # max grad norm (0: none); with zclip, its first 25 steps'
zclip = 0.0            # clip grad-norm spikes above this z-score (ZClip's 2.5; 0: not)
nan_patience = 5       # stop after this many non-finite steps in a row (each is skipped)
lr_find = False        # first run an LR range test, then train with the LR it suggests
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'float32'
if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
    dtype = 'bfloat16'
compile = False
grad_ckpt = False      # recompute each block's activations in backward: less memory
# the largest batch_size that fits, the same global batch (CUDA; or, with gib, the
# largest that keeps at most this many GiB for backward, on any device)
auto_batch = dict(on=False, gib=0.0)
seed = 1337
peak_flops = 989e12    # for MFU: the accelerator's dense bf16 peak (H100 SXM)
# -----------------------------------------------------------------------------
config = {k: v for k, v in globals().items() if k not in _imported and k[0] != '_'}
# --check: the settings resolved and checked, printed (with their ranges) for sweeps
check = '--check' in sys.argv[1:]
config = configure(config, [a for a in sys.argv[1:] if a != '--check'], ranges, RENAMED)
if check:
    print(repr({'settings': settings_shown(config), 'ranges': ranges}))
    sys.exit()
globals().update(config)
# each set-up step below that finds a mistake ends the run in one line (configurator)
with one_line():  # where the run writes, held by this process alone; the zero-shot tasks
    if dataset:  # shards are made there: never inside a checkpoint
        checkpoint.check_output(dataset, 'dataset', made=True)
    checkpoint.make_out_dir(out_dir)
    if os.environ.get('RANK', '0') == '0':  # held until the process ends
        folder_lock = run_state.own_folder(out_dir)
    if os.environ.get('LOCAL_RANK', '0') == '0':
        check_tasks(eval_tasks)

# DDP: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; each rank takes its GPU and its
# share of the accumulation steps. The set-up below finishes the settings (auto batch, the
# LR finder too) before anything takes them; from the optimizers on, they are final.
with one_line():  # the ranks joined; the settings that cannot go together
    ddp, rank, local_rank, world_size, device = join_ranks(device)
    if gradient_accumulation_steps % world_size:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must "
                         f"be a multiple of the {world_size} ranks")
    cpu_compile = compile and device == 'cpu'
    check_sharding(fsdp, zero1, ddp, optimizer, lr_find, cpu_compile, 'block' in objectives)
    check_lora(lora, init_from, fsdp, lambda_warmup)
gradient_accumulation_steps //= world_size  # the same global batch on any ranks
master = rank == 0  # logs, checkpoints and samples
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
ptdtype = getattr(torch, dtype)
ctx = nullcontext()
if ptdtype != torch.float32:
    ctx = torch.autocast(device_type, dtype=ptdtype)
if device_type == 'cuda':  # TF32 tensor cores for what stays fp32, as nanoGPT
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
torch.manual_seed(seed + rank)  # e.g. diffusion's masks (batches have seeds of their own)

# the checkpoint we start from: a storage URL's newest complete one is downloaded to
# out_dir and resumed; a resume reads its training state (`saved`) and keeps its settings
if '://' in init_from and local_rank == 0:
    download_latest(init_from, out_dir)
if '://' in init_from and ddp:
    dist.barrier()
with one_line():
    start, saved = run_state.starting_point(init_from, out_dir, master)
    fixed = {k: config[k] for k in FIXED}
    run_state.check_start(saved, start, fixed, world_size, stop_after, max_steps)
base = saved['base'] if saved and lora['rank'] else start  # LoRA checkpoints: adapters only
run_id = run_state.run_id(saved)  # kept across resumes: the run's upload URL is its own

# data: the tokenizer (the model's own unless one is named, which must encode as it does;
# a resume keeps its own), then the offline corpus or token shards data.py prepares once
# (local rank 0) with the task files it names; a resume sees the batches it would have seen
with one_line('data: '):
    own = checkpoint.tokenizer_of(start) if start and not saved else None
    wanted = tokenizer
    if checkpoint.checkpoints(tokenizer):  # a run's folder: its newest checkpoint's
        wanted = checkpoint.tokenizer_of(checkpoint.latest(tokenizer)) or tokenizer
    enc, tokenizer_name, tokenizer_file = run_tokenizer(
        own, saved['tokenizer'] if saved else '', wanted)
    train_data, val_data, pairs = run_data(dataset, prepare, mixture, remix['interval'],
                                           enc, tokenizer_name, tokenizer_file, dpo_data,
                                           block_size, (task_file, choice_texts_named))
with one_line():  # a fresh run never writes where another run's checkpoints or log are
    if master and init_from != 'resume' and '://' not in init_from:
        run_state.check_fresh(out_dir)
    uploader = Uploader(upload_to, run_id) if upload_to and master else None  # checked now
batches_of = functools.partial(Batches, train_data, val_data, block_size=block_size,
                               rank=rank, world_size=world_size, seed=seed, pairs=pairs,
                               device=device)  # the run's batches, at a micro-batch size

# model: from scratch, or a checkpoint (converted to ternary, SubLN calibrated on batches)
with one_line('model: '):
    if init_from == 'scratch':
        # the vocabulary padded to a multiple of 64 (faster matmuls, spare rows such as
        # diffusion's mask token); documents start with EOS, so it is also the BOS
        model = Transformer(ModelConfig(
            vocab_size=64 * math.ceil(enc.n_vocab / 64), max_seq_len=block_size,
            bos_token_id=eos_id(enc), eos_token_id=eos_id(enc), linear_norm=linear_norm,
            weight_scale=weight_scale, bitnet=bitnet, **arch, **moe))
    else:  # a LoRA run's base is verified on resume as at its start (its checkpoint: already)
        model = run_state.starting_model(base, base == start, enc.n_vocab, block_size, moe)
    check_fits(model.config, batch_size, block_size, device, eval_iters)  # before any batch
model.to(device)
if bitnet and not model.config.bitnet and not lora['rank']:
    model.to_bitnet(batches_of(batch_size).calibration(subln_calib), linear_norm, weight_scale)
if lrc_rank and not model.config.lrc_rank:
    model.add_lrc(lrc_rank)  # the SVD of the (converted) weights' quantization residual
if lora['rank']:  # QLoRA: the base frozen (ternary: packed 2-bit), fp adapters
    adapters = checkpoint.adapter_weights(start) if saved else None  # exact values
    model = setup_lora(model, lora, adapters, start).to(device)
model.checkpoint_activations(grad_ckpt)
raw_model = model
trains = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
if master:
    print(f"{'ternary' if raw_model.config.bitnet else 'fp'} model: "
          f"{raw_model.num_params() / 1e6:.2f}M parameters, {trains:,} trained")

# objectives and the teacher they distil from; GRPO's prompts, read once (under FSDP
# all ranks sample until all are done)
with one_line():
    switch = set_adapters if lora['rank'] else None  # a LoRA run's base: its reference
    teacher_net = teachers.from_settings(teacher, vllm, raw_model, switch, device, ptdtype)
    mask_id = None  # masked diffusion's: the tokenizer's, or a spare embedding row
    if 'diffusion' in objectives:
        mask_id = mask_token(enc, raw_model.config.vocab_size)
    manager = ObjectiveManager.from_settings(objectives, curriculum, blend, teacher_net,
                                             raw_model, mask_id)
    rollouts = Rollouts.from_settings(grpo, manager.readers(), enc, raw_model.config.max_seq_len,
                                      seed, rank, world_size, sync=fsdp)

# auto batch: the largest micro-batch that fits, by trying one forward and backward of
# the run's own kind of batch; the same global batch, in more micro-steps
if auto_batch['on']:
    def make_batch(size):
        """A micro-batch of the run's kind: GRPO's completions of size prompts, or data's."""
        return rollouts.probe(size, device) if rollouts else batches_of(size).get(0, 0)
    batch_size, gradient_accumulation_steps = largest_batch(
        raw_model, manager, make_batch, ctx, batch_size, gradient_accumulation_steps,
        device, auto_batch['gib'], master)
batches = batches_of(batch_size)
model = distribute(raw_model, fsdp, ddp and not fsdp, compile, ptdtype, local_rank)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)  # fp16


def micro_steps(run, model, manager, batches, step, b):
    """Forward and backward over the step's micro-batches, the first of them b; the mean
    loss and metrics. `model` is run.model as it trains: wrapped in DDP, or compiled."""
    steps = gradient_accumulation_steps
    # the logged loss is the mean over all micro-steps, not the last one's
    loss_sum, metrics = 0.0, {}
    samples = [{}] * steps
    if run.rollouts and manager.samples(step / max_steps):  # the model's own completions
        samples, metrics = run.rollouts.step(run.model, step, batches.B, steps)
    for micro in range(steps):
        b = b | samples[micro]
        last = micro == steps - 1
        sync = nullcontext()  # DDP: all-reduce (FSDP: reduce-scatter) after the last only
        if fsdp:
            run.model.set_requires_gradient_sync(last)
        elif ddp and not last:
            sync = model.no_sync()
        with sync:
            with ctx:
                loss, parts = manager(model, b, step / max_steps)
            if not last:  # the next batch while the GPU works
                b = batches.get(step, micro + 1)
            loss_sum = loss_sum + loss.detach().float()
            for k, v in parts.items():  # the mean over micro-steps, like the loss
                metrics[k] = metrics.get(k, 0.0) + v / steps
            # the gradients add up to those of the mean loss
            run.scaler.scale(loss / steps).backward()
    return loss_sum / steps, metrics


def new_optimizers(model, lr):
    """AdamW, or Muon on the hidden matrices, each group at its own base LR (the hidden
    matrices' at lr); zero1 shards their state over the ranks."""
    groups = param_groups(model, lr, weight_decay, group_lr['embed'], group_lr['head'],
                          group_lr['scalar'])
    return make_optimizers(groups, optimizer, lr, (adamw['beta1'], adamw['beta2']), zero1)


if lr_find and saved:  # the LR the range test found when the run began (saved below)
    learning_rate, min_lr = saved['config']['learning_rate'], saved['config']['min_lr']
elif lr_find:  # throwaway optimizers; the model is put back afterwards
    probe = TrainState(raw_model, new_optimizers(raw_model, learning_rate), scaler,
                       rollouts=rollouts)

    def lr_probe(i, lr):
        """One optimizer step at LR lr on step i's batches; its loss."""
        set_lr(probe.optimizers, lr / learning_rate)
        loss, _ = micro_steps(probe, model, manager, batches, 0, batches.get(i, 0))
        optimizer_step(probe.optimizers, probe.scaler)
        return rank_mean(loss).item()
    found = find_lr(lr_probe, out_dir, raw_model, verbose=master)
    min_lr = min_lr * found / learning_rate
    learning_rate = found
    config |= dict(learning_rate=learning_rate, min_lr=min_lr)  # saved with the settings
# the run's state (run_state.TrainState: all a checkpoint saves), restored on a resume
run = TrainState(raw_model, new_optimizers(raw_model, learning_rate), scaler,
                 ZClip(zclip, max_norm=grad_clip) if zclip else None, batches.loader,
                 rollouts, config, tokenizer_name, tokenizer_file, base, run_id,
                 run_state.git_commit(), out_dir=out_dir, keep_last=ckpt['keep_last'],
                 fsdp=fsdp, zero1=zero1, lora=lora)
if saved:
    run.restore(saved, rank, device_type, fsdp)
    if master:
        print(f"resumed from {start} at step {run.step}: weights, optimizer, schedule, "
              f"RNG and data position restored (best val {run.best_val:.4f} at step "
              f"{run.best_step})")
val_bytes = token_bytes(enc, raw_model.config.vocab_size).to(device)  # each token's bytes


def batch_ce(m, b):
    """A batch's CE loss: remixing compares the sources' gradients with val's."""
    with ctx:
        return ce_loss(m(b['x'].to(device)), b['y'].to(device))


# the training loop
wandb = start_wandb(wandb_project, settings_shown(config)) if master else None
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
    since = next((k for k in rewarm if manager.new_phase(step - k, max_steps)), None)
    if since is not None:  # the steps since the curriculum's last switch, warming up
        factor *= (since + 1) / warmup_steps
    lrs = set_lr(run.optimizers, factor)
    if schedule == 'two_stage' and step >= max_steps // 2:  # BitNet b1.58's second stage
        drop_weight_decay(run.optimizers)
    if lambda_warmup:
        set_lambda(raw_model, min(1.0, step / (lambda_warmup * max_steps)))
    if phase_reset and manager.new_phase(step, max_steps):
        reset_moments(run.optimizers)
    # the weights hold still until the optimizer steps: kernels.py quantizes each one once
    # for all micro-steps (and reuses an input's codes), and forgets it all at the end
    with holding_weights():
        train_loss, metrics = micro_steps(run, model, manager, batches, step, b)
    grad_norm, zclipped = clip_gradients(model, run.optimizers, scaler, grad_clip, run.zclip)
    skipped = not math.isfinite(grad_norm.item())
    # a NaN/Inf loss or gradient (fp16 overflow, a bad batch): skip the step, or stop
    nan_run = nan_run + 1 if skipped else 0
    if nan_run >= nan_patience:
        sys.exit(f"error: {nan_run} non-finite steps in a row at step {step}; "
                 "lower the learning rate or check the data")
    optimizer_step(run.optimizers, scaler, skipped)
    step = run.step_done()
    tokens_seen += tokens_per_step
    mix = {}
    if remix['interval'] and step % remix['interval'] == 0:  # before the next batch is drawn
        mix = remix_mixture(model, batch_ce, batches.loader, batches.val_batches(2),
                            remix['eta'], remix['floor'])
    if batches.loader:  # where the next step reads
        data_state = batches.loader.state_dict()
    b = batches.get(step, 0)
    last = step in (max_steps, stop_after)  # of the run, or of its chunk

    # evaluate: the val loss (and samples), the best one so far, early stopping
    rec, improved, stop = {}, False, False
    if step % eval_interval == 0 or last:
        with holding_weights():  # as in the micro-steps
            rec['val_loss'], rec['val_bpb'] = val_loss(
                model, batches.val_batches(eval_iters), val_bytes, ctx, master)
            if sample['prompts'] and (master or fsdp):  # under FSDP every rank runs each forward
                with ctx:  # greedy continuations, read beside the losses
                    rec['samples'] = complete(raw_model, enc, sample['prompts'], 48)
            if rollouts and rollouts.heldout and (master or fsdp):  # each reward's mean
                rec.update(rollouts.heldout_scores(raw_model))
            if eval_tasks and (master or fsdp):  # {task: {'acc', 'acc_norm', ...}}
                with ctx:
                    rec['zero_shot'] = zero_shot(raw_model, enc, eval_tasks,
                                                 raw_model.config.max_seq_len, device=device)
        improved, stop = run.scored(rec['val_loss'], **early_stop)
        if not improved:
            rec['early_stop'] = stop

    # log: one JSON line per logged step, and a line on the console
    if step % log_interval == 0 or rec or skipped or zclipped or mix:
        now = time.time()
        tok_per_s = tokens_per_step * (step - step_last) / (now - t_last)
        loss = rank_mean(train_loss).item()
        rec.update(step=step, loss=loss, grad_norm=grad_norm.item(), **lrs,
                   tokens=tokens_seen, tok_per_s=round(tok_per_s),
                   time_s=round(now - t_start, 2))
        for k, v in metrics.items():
            rec[k] = rank_mean(v).item() if torch.is_tensor(v) else v
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

    # checkpoint: on a better val loss, at the end, at an early stop, every ckpt interval
    if improved or last or stop or (ckpt['interval'] and step % ckpt['interval'] == 0):
        run.save(device_type, data_state, uploader)
    if stop:
        if master:
            print(f"early stop: no val improvement above {early_stop['min_delta']} in "
                  f"{early_stop['patience']} evals (best {run.best_val:.4f} at step "
                  f"{run.best_step})")
        break

if (master or fsdp) and sample['tokens']:
    # at temperature 0.6 the tiny default model writes mostly real words (0.8: made up)
    with ctx:
        text = 'The ' + complete(raw_model, enc, ['The '], sample['tokens'], 0.6, 50)[0]
    if master:
        print('-' * 40 + '\n' + text + '\n' + '-' * 40)
if uploader:
    uploader.close()  # waits for the last upload
if ddp:
    dist.destroy_process_group()
    time.sleep(0.2)  # gloo's threads free the last tensors under the GIL; exiting at once aborts
