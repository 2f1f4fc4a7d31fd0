"""
How a run starts, resumes and keeps its folder: where it starts from (scratch, a model,
or its own newest checkpoint and training state), the checks a resume must pass, and
`TrainState`, everything a checkpoint saves and a resume restores (checkpoint.py writes
and opens the checkpoints themselves).

A run folder belongs to the run that made it. `own_folder` holds it for one process at a
time, with a lock that the operating system drops when the process ends, crashed or not,
and refuses a fresh run (not a resume) where another run's checkpoints or log already
are: nothing of an earlier run is replaced without being asked. The functions here take
the settings they need as arguments; none knows train.py's names.
"""
import fcntl
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from checkpoint import (STATE, check_base, checkpoint_name, checkpoints, find, identity,
                        latest, load, open_found, read_state, save)
from hub import settings_shown
from lora import save_adapters

def hold(folder):
    """A lock on `folder` itself (flock on the open folder: nothing is written in it),
    held by this process until it ends, crashed or not (the operating system lets go):
    the open descriptor (keep it), or None when another process holds it."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        return None
    return handle


def own_folder(out_dir, wait=3.0):
    """Hold out_dir for this process (hold); a ValueError, naming the folder and the ways
    on, when another process still holds it after `wait` seconds (the ranks of a run just
    killed take a moment to exit and let go)."""
    handle = hold(out_dir)
    until = time.monotonic() + wait
    while handle is None and time.monotonic() < until:
        time.sleep(0.1)
        handle = hold(out_dir)
    if handle is None:
        raise ValueError(f"out_dir={out_dir!r} is in use by another run; wait for it to "
                         f"end or set --out_dir to another folder")
    return handle


def check_fresh(out_dir):
    """A ValueError, naming the folder and the ways on, when a fresh run (not a resume)
    would write where another run's checkpoints or log already are."""
    names = sorted(os.listdir(out_dir))
    earlier = [n for n in names if checkpoint_name(n) or n == 'log.jsonl']
    if earlier:
        raise ValueError(f"out_dir={out_dir!r} holds another run ({', '.join(earlier[:3])}); "
                         f"continue it with --init_from=resume, or set --out_dir to a new "
                         f"folder")


def git_commit():
    """The commit of the code that writes a checkpoint, or '' without git."""
    if not shutil.which('git'):
        return ''
    here = os.path.dirname(os.path.abspath(__file__))
    git = ['git', 'rev-parse', 'HEAD']
    return subprocess.run(git, capture_output=True, text=True, cwd=here).stdout.strip()


def resume(folder, rank0=True):
    """The newest intact checkpoint of a run's folder and its training state. Raises
    FileNotFoundError, saying what to do, when there is none."""
    if not checkpoints(folder):
        raise FileNotFoundError(f"no checkpoint in {folder!r} to resume from; "
                                f"train first or set --out_dir")
    try:
        ckpt = latest(folder, set_aside=rank0, warn=rank0)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; start over with --init_from=scratch") from None
    return ckpt, read_state(os.path.join(ckpt, STATE))


def starting_point(init_from, out_dir, rank0=True):
    """(the directory a run starts from, the training state it resumes): (None, None) from
    scratch; a resume ('resume', or a storage URL already downloaded into out_dir) takes
    out_dir's newest intact checkpoint and its state; anything else is found (find)."""
    if init_from == 'resume' or '://' in init_from:
        return resume(out_dir, rank0)
    if init_from == 'scratch':
        return None, None
    try:
        return find(init_from), None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load {init_from!r}: {e}") from None


def check_start(saved, start, fixed, world_size, stop_after, max_steps):
    """A ValueError when a resumed run's `fixed` settings ({name: value}: those a resume
    cannot change; one newer than its checkpoint counts as unchanged) differ from those
    it was trained with, when it resumes on another number of ranks, or when stop_after
    does not lie between the step it starts at and max_steps; and when a resumed LoRA
    run's base is not the model its adapters were trained on."""
    first_step = saved['step'] if saved else 0
    if saved and saved.get('base'):
        check_base(start, saved['base'], saved.get('base_identity'))
    if saved:
        was = fixed | {k: v for k, v in saved['config'].items() if k in fixed}
        changed = []
        for k, value in fixed.items():
            if isinstance(value, dict):  # a group: key by key
                changed += [f"{k}.{n}={was[k].get(n)!r} (now {v!r})"
                            for n, v in value.items() if was[k].get(n, v) != v]
            elif was[k] != value:
                changed.append(f"{k}={was[k]!r} (now {value!r})")
        if changed:
            raise ValueError(f"{start} was trained with {', '.join(changed)}; resume with "
                             f"the same settings or a new out_dir")
        if len(saved['rng']) != world_size:
            raise ValueError(f"{start} was trained on {len(saved['rng'])} ranks; resume on "
                             f"as many")
    if stop_after and not first_step < stop_after < max_steps:
        raise ValueError(f"stop_after={stop_after} must lie after step {first_step}, "
                         f"below max_steps")


def starting_model(src, found, n_vocab, block_size, moe):
    """The model a run starts from (load, unpacked; not verified again when `found`),
    checked against the run's tokenizer (n_vocab tokens) and block_size; a dense one
    upcycled to a mixture of experts when moe's n_experts asks for one."""
    try:
        if found:
            model = open_found(src, packed=False)[1]
        else:
            model = load(src, packed=False)[1]
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"cannot load {src!r}: {e}") from None
    if n_vocab > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {n_vocab} tokens but {src} only "
                         f"{model.config.vocab_size}; use the model's tokenizer")
    if model.config.max_seq_len < block_size:
        raise ValueError(f"block_size={block_size} exceeds max_seq_len="
                         f"{model.config.max_seq_len}")
    if moe['n_experts'] and not model.config.n_experts:  # before conversion to ternary
        model.upcycle(**moe)
    return model


def run_id(state):
    """The run's id: the one its resumed training state carries, else a new one. It stays
    with the run across resumes and marks the upload prefix the run owns (remote.py)."""
    return (state or {}).get('run_id') or uuid.uuid4().hex


def rng_state(device_type):
    """This process's random generators: the CPU's, and the GPU's on one."""
    cuda = torch.cuda.get_rng_state() if device_type == 'cuda' else None
    return {'cpu': torch.get_rng_state(), 'cuda': cuda}


def set_rng_state(saved, device_type):
    torch.set_rng_state(saved['cpu'])
    if device_type == 'cuda' and saved['cuda'] is not None:
        torch.cuda.set_rng_state(saved['cuda'])


def fsdp_state_dict():
    """torch's state dicts of sharded models, and options for whole tensors on rank 0's CPU;
    imported only under FSDP, as they take seconds to import."""
    import torch.distributed.checkpoint.state_dict as dcp
    return dcp, dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model, fsdp=False):
    """Under FSDP, the whole model's weights on rank 0's CPU, gathered tensor by tensor
    (a collective); else None: the model saves its own."""
    if not fsdp:
        return None
    dcp, full = fsdp_state_dict()
    return dcp.get_model_state_dict(model, options=full)


def optimizer_states(model, optimizers, fsdp=False, zero1=False, rank0=True):
    """Every optimizer's whole state on rank 0 (None elsewhere). A collective under FSDP
    and ZeRO-1, where each rank holds the state of its own shards."""
    if zero1:
        for opt in optimizers:
            opt.consolidate_state_dict(to=0)
    if fsdp:
        dcp, full = fsdp_state_dict()
        return [dcp.get_optimizer_state_dict(model, o, options=full) for o in optimizers]
    return [o.state_dict() for o in optimizers] if rank0 else None


def load_optimizer_states(model, optimizers, states, fsdp=False):
    """What optimizer_states saved; under FSDP each rank takes its shards of it."""
    for opt, state in zip(optimizers, states):
        if fsdp:
            dcp, full = fsdp_state_dict()
            dcp.set_optimizer_state_dict(model, opt, state, options=full)
        else:
            opt.load_state_dict(state)


@dataclass
class TrainState:
    """Everything a checkpoint saves and a resume restores, in one object: the objects
    whose state travels with a run (the model, its optimizers, the fp16 gradient scaler,
    ZClip, the token shards' loader, GRPO's rollouts), what the run is (its settings,
    tokenizer, base model, id, code commit), where it stands (step, the best val loss
    and its step, evals since an improvement) and how it saves (its folder, how many
    checkpoints it keeps, its sharding, its LoRA settings: rank, alpha, targets). Built
    once, after train.py's set-up; the loop moves it on, save writes it."""
    model: torch.nn.Module
    optimizers: list
    scaler: torch.amp.GradScaler
    zclip: object = None     # optim.ZClip, or None
    loader: object = None    # data.Loader, or None (the offline corpus: no position)
    rollouts: object = None  # rl.Rollouts, or None
    config: dict = field(default_factory=dict)
    tokenizer: str = 'bytes'
    tokenizer_file: str = None  # copied into every checkpoint, when there is one
    base: str = None         # a LoRA run's frozen base model
    run_id: str = ''
    commit: str = ''
    step: int = 0
    best_val: float = float('inf')
    best_step: int = 0
    bad_evals: int = 0
    out_dir: str = 'out'
    keep_last: int = 2
    fsdp: bool = False
    zero1: bool = False
    lora: dict = field(default_factory=lambda: dict(rank=0))
    base_identity: str = None  # a LoRA run's base's (checkpoint.identity), set at its start

    def __post_init__(self):
        if self.lora['rank'] and self.base:  # the adapters' base, as it is when they start
            self.base_identity = identity(self.base)

    def rank_state(self, device_type, data_state):
        """What each rank keeps of its own: its RNG, its data position (`data_state`,
        the loader's as it was before the step's next batch was drawn), its rollouts."""
        mine = rng_state(device_type) | {'data': data_state}
        if self.rollouts:
            mine['rollouts'] = self.rollouts.state_dict()
        return mine

    def state_dict(self, optimizers, ranks):
        """train_state.pt's content: the whole optimizer state (optimizer_states) and
        every rank's rank_state, as rank 0 gathered them."""
        return dict(step=self.step, best_val=self.best_val, best_step=self.best_step,
                    bad_evals=self.bad_evals, base=self.base,
                    base_identity=self.base_identity, optimizers=optimizers,
                    scaler=self.scaler.state_dict(), rng=ranks,
                    config=settings_shown(self.config),  # no URL's credentials
                    commit=self.commit, tokenizer=self.tokenizer, run_id=self.run_id,
                    zclip=self.zclip.state_dict() if self.zclip else None)

    def restore(self, saved, rank, device_type, fsdp=False):
        """A resumed checkpoint's state (train_state.pt) back into place, on this rank:
        the optimizers, scaler and ZClip, this rank's RNG, data position and rollouts,
        and where the run stood."""
        load_optimizer_states(self.model, self.optimizers, saved['optimizers'], fsdp)
        self.scaler.load_state_dict(saved['scaler'])
        if self.zclip:
            self.zclip.load_state_dict(saved['zclip'])
        mine = saved['rng'][rank]
        set_rng_state(mine, device_type)  # e.g. the masks of masked diffusion
        if self.rollouts:  # GRPO's completions, when a resume falls between two samplings
            self.rollouts.load_state_dict(mine['rollouts'])
        if self.loader:
            self.loader.load_state_dict(mine['data'])
        self.step, self.best_val = saved['step'], saved['best_val']
        self.best_step, self.bad_evals = saved['best_step'], saved['bad_evals']

    def step_done(self):
        """One more optimizer step taken; the run's new step."""
        self.step += 1
        return self.step

    def scored(self, val_loss, patience=0, min_delta=0.0):
        """An evaluation at this step: (improved: val_loss is below the best by more than
        min_delta, now the best; stop: `patience` evaluations in a row without an
        improvement, 0 never stopping)."""
        if val_loss < self.best_val - min_delta:
            self.best_val, self.best_step, self.bad_evals = val_loss, self.step, 0
            return True, False
        self.bad_evals += 1
        return False, bool(patience) and self.bad_evals >= patience

    def save(self, device_type, data_state, uploader=None):
        """Rank 0 gathers every rank's RNG state and data position (and the shards of FSDP
        and ZeRO-1), then writes the checkpoint into the run's out_dir (save: atomic, with
        a manifest) and hands it to the uploader; every rank stops if that fails."""
        ddp = dist.is_initialized()
        master = not ddp or dist.get_rank() == 0
        fsdp, lora = self.fsdp, self.lora
        mine = self.rank_state(device_type, data_state)
        ranks = [mine] * (dist.get_world_size() if ddp else 1)
        if ddp:
            dist.all_gather_object(ranks, mine)
        weights = model_state(self.model, fsdp)
        zero1 = self.zero1 and ddp
        opts = optimizer_states(self.model, self.optimizers, fsdp, zero1, master)
        failed = [None]
        if master:
            # the Hugging Face directory; with LoRA, the adapters alone (PEFT's layout)
            write = partial(self.model.save_pretrained, state_dict=weights)
            if lora['rank']:
                write = partial(save_adapters, self.model.layers, rank=lora['rank'],
                                alpha=lora['alpha'], targets=lora['targets'].split(','),
                                base=self.base)
            failed[0] = save(self.out_dir, self.step, write, self.state_dict(opts, ranks),
                             self.tokenizer_file, self.keep_last, self.best_step)
            if uploader and not failed[0]:
                uploader.submit(self.out_dir, self.step, self.best_step)
        if ddp:  # every rank learns whether rank 0 failed: none waits in a collective
            dist.broadcast_object_list(failed, src=0)
        if failed[0]:
            if ddp:
                dist.destroy_process_group()
            sys.exit(f"error: {failed[0]}" if master else 1)
