"""
Checkpoints: how a run's state is written so that none is ever half, and how every
script finds the newest good one.

A checkpoint `out/ckpt_0000750/` is a Hugging Face directory (config.json,
model.safetensors, the tokenizer files; transformers opens it; with LoRA, PEFT's adapter
files instead) plus train_state.pt, everything else a resume needs (optimizer, scaler,
RNG of every rank, data position, best val loss, the config). It is written under a
temporary name (`.tmp_ckpt_*`) and renamed when complete, so a crash during a save never
leaves a broken newest checkpoint. Last comes manifest.json, the size and sha256 of
every file: a disk can still cut or flip bytes later, and the manifest is how a reader
tells. A failed write (a full disk) removes its temporary directory and says in one line
which checkpoint is intact.

`find` is the one way every script finds a checkpoint: a run's folder gives its newest
intact one (a damaged one is skipped with a warning), a checkpoint named directly is
verified, a hub id is downloaded. `load` is the one way every script opens one: the model
(a LoRA checkpoint's adapters added onto the base it names, a ternary model packed when
asked) and the name of the tokenizer it was trained with (`tokenizer_of`).
"""
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from hub import TOKENIZER_FILES, inside, resolve_model
from lora import WEIGHTS, add_lora, load_adapters, read_config, save_adapters
from model import Transformer

STATE = 'train_state.pt'
MANIFEST = 'manifest.json'
# train.py's settings a resumed run cannot change (a setting newer than its checkpoint
# counts as unchanged)
FIXED = ('arch', 'bitnet', 'moe', 'lrc_rank', 'lora', 'tokenizer', 'optimizer', 'zero1',
         'linear_norm', 'weight_scale')


# a checkpoint's folder: exactly what save names it (ASCII digits: \d would take others);
# nothing else (a copy 'ckpt_0000002.bak', a link) is ever read, rotated or removed as one
NAME = re.compile(r'ckpt_[0-9]{7}')


def checkpoints(folder):
    """Complete checkpoints in a run's folder, oldest first: real folders named as save
    names them (saves in progress are .tmp_ckpt_*)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    paths = [os.path.join(folder, n) for n in names if NAME.fullmatch(n)]
    return sorted(p for p in paths if os.path.isdir(p) and not os.path.islink(p))


def check_output(path, setting, made=False):
    """A script's output path, checked before any work: its folder exists (unless the
    script makes it), and neither it nor a folder above it is a checkpoint, where a file
    written would damage it or overwrite its weights. Raises ValueError naming `setting`."""
    real = os.path.realpath(path)
    if not made and not os.path.isdir(os.path.dirname(real)):
        raise ValueError(f"{setting}={path!r}: its folder does not exist; make it first "
                         f"or set --{setting} elsewhere")
    folder = real
    while folder != os.path.dirname(folder):
        name = os.path.basename(folder)
        named = NAME.fullmatch(name) or name.startswith(('.tmp_ckpt_', 'damaged_ckpt_'))
        if named or os.path.isfile(os.path.join(folder, MANIFEST)):
            raise ValueError(f"{setting}={path!r} is inside the checkpoint {folder}; "
                             f"set --{setting} outside it")
        folder = os.path.dirname(folder)


def make_out_dir(out_dir):
    """A run's folder, made if it is not there; a ValueError saying what to set when it
    cannot be made or written."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot make out_dir={out_dir!r} ({e.strerror}); set --out_dir "
                         f"to a folder this run can write") from None
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"out_dir={out_dir!r} is not writable; set --out_dir to a folder "
                         f"this run can write")


def fingerprint(path):
    """[size, sha256] of a file:
    what manifest.json records for each file of a checkpoint."""
    with open(path, 'rb') as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.file_digest(f, 'sha256').hexdigest()
        return [size, digest]


def damage(ckpt):
    """What is wrong with a checkpoint, or None when its manifest.json lists exactly
    the files beside it, each with the size and sha256 recorded there. A manifest may
    come from a bucket or a copied folder, so it is hostile until checked: an object of
    plain file names to [size, sha256], nothing missing, nothing left out. Sizes are
    compared before any hashing, so that an endless or a huge file is never read."""
    try:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable {MANIFEST} ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict) or not manifest:
        return f"{MANIFEST} is not an object naming the checkpoint's files"
    for name, recorded in manifest.items():
        try:
            inside(ckpt, name, f"{MANIFEST} entry")
        except ValueError as e:
            return str(e)
        shaped = isinstance(recorded, list) and len(recorded) == 2
        if not (shaped and type(recorded[0]) is int and isinstance(recorded[1], str)):
            return f"{MANIFEST} records {name!r} as something else than [size, sha256]"
    present = set(os.listdir(ckpt)) - {MANIFEST}
    odd = sorted(set(manifest) ^ present)  # named but missing, or there but not named
    if odd:
        return (f"{MANIFEST} does not list exactly the files there "
                f"({odd[0]!r} and {len(odd) - 1} more)")
    for name, (size, _) in manifest.items():
        info = os.lstat(os.path.join(ckpt, name))  # a symlink is no file of a checkpoint
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return f"{name} is damaged (not a file of the size in {MANIFEST})"
    for name, recorded in manifest.items():
        if fingerprint(os.path.join(ckpt, name)) != recorded:
            return f"{name} is damaged (its sha256 is not the one in {MANIFEST})"
    return None


def latest(folder, set_aside=False, warn=True):
    """The newest intact checkpoint of a run's folder. A damaged one is skipped with a
    one-line warning (unless not `warn`: a rank other than 0) and, with set_aside (the
    run that will write new ones), renamed damaged_ckpt_* (not deleted), so that the
    next saves cannot count it."""
    for ckpt in reversed(checkpoints(folder)):
        problem = damage(ckpt)
        if problem is None:
            return ckpt
        name = os.path.basename(ckpt)
        note = "falling back to the checkpoint before it"
        if set_aside:  # beside any set aside before at this step, never over it
            aside = os.path.join(folder, 'damaged_' + name)
            tries = 1
            while os.path.lexists(aside):
                aside = os.path.join(folder, f'damaged_{name}.{tries}')
                tries += 1
            os.replace(ckpt, aside)
            note = f"renamed to {os.path.basename(aside)}, " + note
        if warn:
            print(f"warning: {ckpt}: {problem}; {note}", file=sys.stderr)
    raise FileNotFoundError(f"no intact checkpoint left in {folder!r}")


def is_model_dir(path):
    names = ('config.json', 'adapter_config.json')
    return any(os.path.exists(os.path.join(path, f)) for f in names)


def find(src, set_aside=False):
    """A checkpoint directory to load from `src`: a run's folder (its newest intact
    checkpoint), a checkpoint or Hugging Face directory (verified when it has a
    manifest), or a hub id (downloaded). Raises an OSError or ValueError whose message
    says what is wrong."""
    if os.path.isdir(src) and not is_model_dir(src):
        if not checkpoints(src):
            raise FileNotFoundError(f"no checkpoint in {src!r}; train one with python "
                                    f"train.py or name a checkpoint directory")
        return latest(src, set_aside)
    path = resolve_model(src)
    if os.path.exists(os.path.join(path, MANIFEST)):
        problem = damage(path)
        if problem:
            raise ValueError(f"cannot read {path}: {problem}; "
                             f"name an intact checkpoint, or the run's folder "
                             f"to take its newest intact one")
    return path


def tokenizer_of(ckpt):
    """The tokenizer a checkpoint directory's model was trained with: the directory itself
    when a tokenizer.json lies beside the weights, else the name its training state keeps
    (tiktoken's and the byte tokenizer have no file), else None."""
    if os.path.isfile(os.path.join(ckpt, 'tokenizer.json')):
        return ckpt
    state = os.path.join(ckpt, STATE)
    if os.path.isfile(state):
        return read_state(state).get('tokenizer') or None
    return None


def read_state(path):
    """A training state file as plain tensors and containers (weights_only: a pickle that
    would run code is refused, in one line, not torch's advice to load it unchecked)."""
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds more than tensors and plain containers: refused, "
                         "as loading it could run code; train from an intact checkpoint") from None
    except (RuntimeError, EOFError, ValueError) as e:
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"{path} is no readable training state ({first})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is no training state (not a dict)")
    return state


def load(src, device='cpu', packed=True, tokenizer=''):
    """(checkpoint directory, model in eval mode, tokenizer name) for `src`: a run's
    folder, a checkpoint, a Hugging Face directory or a hub id (find). A LoRA checkpoint
    (adapter_config.json) is loaded onto the base it names, adapters added. A ternary
    model is frozen to 2-bit weights when `packed`. The tokenizer is `tokenizer` if given,
    else the checkpoint's own (tokenizer_of), else 'bytes'. Raises OSError, ValueError,
    RuntimeError or KeyError saying what is wrong."""
    return open_found(find(src), device, packed, tokenizer)


def open_found(ckpt, device='cpu', packed=True, tokenizer=''):
    """load() for a directory that find (or resume) already gave and verified."""
    lora = read_config(ckpt)  # a LoRA checkpoint holds the adapters alone
    base = lora['base_model_name_or_path'] if lora else ckpt
    model = Transformer.from_pretrained(base).to(device).eval()
    if lora:
        add_lora(model.layers, lora['r'], lora['lora_alpha'], lora['target_modules'])
        load_adapters(model.layers, adapter_weights(ckpt), ckpt)
    if packed and model.config.bitnet and not model.config.packed:
        model.freeze()
    return ckpt, model, tokenizer or tokenizer_of(ckpt) or 'bytes'


def adapter_weights(ckpt):
    """A LoRA checkpoint's adapter weights (PEFT's file), as tensors."""
    file = os.path.join(ckpt, WEIGHTS)
    try:
        return load_file(file)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read {file} ({e}); save the adapters again") from None


def copy_tokenizer(tokenizer_file, dest):
    """The tokenizer.json (and its chat template files beside it)
    go with the weights."""
    shutil.copy(tokenizer_file, os.path.join(dest, 'tokenizer.json'))
    for extra in TOKENIZER_FILES[1:]:
        found = os.path.join(os.path.dirname(tokenizer_file), extra)
        if os.path.exists(found):
            shutil.copy(found, dest)


def save(folder, step, write_weights, state, tokenizer_file=None, keep=2, best_step=0):
    """Write checkpoint `step` of a run into folder: write_weights(directory) writes the
    Hugging Face part, `state` goes to train_state.pt, the manifest last, then the
    rename. Then all but the newest `keep` and the best are removed.
    Returns None, or why the write failed (earlier checkpoints are then untouched and
    no temporary directory is left)."""
    final = os.path.join(folder, f'ckpt_{step:07d}')
    tmp = os.path.join(folder, f'.tmp_ckpt_{step:07d}')
    prev = checkpoints(folder)[-1:]
    need = sum(os.path.getsize(e.path) for e in os.scandir(prev[0])) if prev else 0
    free = shutil.disk_usage(folder).free
    if need > free:  # warn before a save that cannot fit
        print(f"warning: {folder} has {free / 2**20:.1f} MiB free, "
              f"the last checkpoint took {need / 2**20:.1f} MiB", file=sys.stderr)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write_weights(tmp)
        if tokenizer_file:
            copy_tokenizer(tokenizer_file, tmp)
        torch.save(state, os.path.join(tmp, STATE))
        names = sorted(os.listdir(tmp))
        manifest = {name: fingerprint(os.path.join(tmp, name)) for name in names}
        with open(os.path.join(tmp, MANIFEST), 'w') as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except (OSError, RuntimeError, SafetensorError) as e:
        # torch.save reports a full disk as "unexpected pos": the free space tells
        no_space = getattr(e, 'errno', None) == errno.ENOSPC
        full = no_space or shutil.disk_usage(folder).free < 2**20
        shutil.rmtree(tmp, ignore_errors=True)
        error = f"{type(e).__name__}: {e}".splitlines()[0]
        cause = 'no space left on device' if full else error
        kept = "no earlier one exists"
        if prev:
            kept = f"the last complete one, {prev[0]}, is intact"
        return (f"cannot write checkpoint {final} ({cause}); {kept}. "
                f"Free space in {folder} (or set --out_dir), "
                f"then continue with --init_from=resume")
    best = os.path.join(folder, f'ckpt_{best_step:07d}')
    for old in checkpoints(folder)[:-keep]:
        if old != best:
            shutil.rmtree(old)
    print(f"saved {final}")
    return None


# ---------------------------------------------------------------- the training state

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


def check_start(saved, start, config, world_size):
    """A ValueError when a resumed run's FIXED settings differ from those it was trained
    with, when it resumes on another number of ranks, or when config's stop_after does
    not lie between the step it starts at and max_steps."""
    first_step = saved['step'] if saved else 0
    if saved:
        was = config | saved['config']
        changed = []
        for k in FIXED:
            if isinstance(config[k], dict):  # a group: key by key
                changed += [f"{k}.{n}={was[k].get(n)!r} (now {v!r})"
                            for n, v in config[k].items() if was[k].get(n, v) != v]
            elif was[k] != config[k]:
                changed.append(f"{k}={was[k]!r} (now {config[k]!r})")
        if changed:
            raise ValueError(f"{start} was trained with {', '.join(changed)}; resume with "
                             f"the same settings or a new out_dir")
        if len(saved['rng']) != world_size:
            raise ValueError(f"{start} was trained on {len(saved['rng'])} ranks; resume on "
                             f"as many")
    stop_after, max_steps = config['stop_after'], config['max_steps']
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


def read_log(path):
    """A run's log.jsonl as its records. A line that is no record (the last one, cut off
    by a crash mid-write) is dropped with a warning."""
    records = []
    with open(path, 'rb') as f:  # bytes: a line that is no UTF-8 is one more bad line
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:  # UnicodeDecodeError included
                record = None
            if isinstance(record, dict) and isinstance(record.get('step'), int):
                records.append(record)
            else:
                print(f"warning: {path}: line {number} is cut off or no record; dropping it",
                      file=sys.stderr)
    return records


def truncate_log(path, step):
    """Drop the records of a run's log.jsonl past `step`, where it resumes."""
    if os.path.exists(path):
        kept = [record for record in read_log(path) if record['step'] <= step]
        with open(path, 'w') as f:
            f.writelines(json.dumps(record) + '\n' for record in kept)


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
    tokenizer, base model, id, code commit) and where it stands (step, the best val loss
    and its step, evals since an improvement). Built once, after train.py's set-up; the
    loop moves it on, save writes it."""
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
                    bad_evals=self.bad_evals, base=self.base, optimizers=optimizers,
                    scaler=self.scaler.state_dict(), rng=ranks, config=self.config,
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
        fsdp, lora = self.config['fsdp'], self.config['lora']
        mine = self.rank_state(device_type, data_state)
        ranks = [mine] * (dist.get_world_size() if ddp else 1)
        if ddp:
            dist.all_gather_object(ranks, mine)
        weights = model_state(self.model, fsdp)
        zero1 = self.config['zero1'] and ddp
        opts = optimizer_states(self.model, self.optimizers, fsdp, zero1, master)
        failed = [None]
        if master:
            # the Hugging Face directory; with LoRA, the adapters alone (PEFT's layout)
            write = partial(self.model.save_pretrained, state_dict=weights)
            if lora['rank']:
                write = partial(save_adapters, self.model.layers, rank=lora['rank'],
                                alpha=lora['alpha'], targets=lora['targets'].split(','),
                                base=self.base)
            failed[0] = save(self.config['out_dir'], self.step, write,
                             self.state_dict(opts, ranks), self.tokenizer_file,
                             self.config['ckpt']['keep_last'], self.best_step)
            if uploader and not failed[0]:
                uploader.submit(self.config['out_dir'], self.step, self.best_step)
        if ddp:  # every rank learns whether rank 0 failed: none waits in a collective
            dist.broadcast_object_list(failed, src=0)
        if failed[0]:
            if ddp:
                dist.destroy_process_group()
            sys.exit(f"error: {failed[0]}" if master else 1)
