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
asked) and the name of the tokenizer it was trained with (`tokenizer_of`). How a run
starts and resumes from one, and what fills its train_state.pt: run_state.py.
"""
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import stat
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hub import TOKENIZER_FILES, inside, resolve_model
from lora import WEIGHTS, add_lora, load_adapters, read_config
from model import Transformer

STATE = 'train_state.pt'
MANIFEST = 'manifest.json'


# a checkpoint's folder: exactly what save names it (ASCII digits: \d would take others);
# nothing else (a copy 'ckpt_0000002.bak', a link) is ever read, rotated or removed as one
NAME = re.compile(r'ckpt_[0-9]{7}')


def checkpoints(folder):
    """Complete checkpoints in a run's folder, oldest first: real folders named as save
    names them (saves in progress are .tmp_ckpt_*)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    paths = [os.path.join(folder, n) for n in names if NAME.fullmatch(n)]
    return sorted(p for p in paths if os.path.isdir(p) and not os.path.islink(p))


def checkpoint_name(name):
    """A name save gives a checkpoint, whole, in progress (.tmp_ckpt_*) or set aside
    (damaged_ckpt_*)."""
    return bool(NAME.fullmatch(name)) or name.startswith(('.tmp_ckpt_', 'damaged_ckpt_'))


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
        if checkpoint_name(name) or os.path.isfile(os.path.join(folder, MANIFEST)):
            raise ValueError(f"{setting}={path!r} is inside the checkpoint {folder}; "
                             f"set --{setting} outside it")
        folder = os.path.dirname(folder)


def make_out_dir(out_dir):
    """A run's folder, made if it is not there; a ValueError saying what to set when it
    cannot be made or written, or when it is (or lies inside) a checkpoint or a model's
    folder, whose files a run's would mix with."""
    check_output(out_dir, 'out_dir', made=True)
    if is_model_dir(out_dir):
        raise ValueError(f"out_dir={out_dir!r} is a model's folder; set --out_dir to a "
                         f"folder of its own")
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


def identity(path):
    """A model directory's identity: the sha256 of its manifest (a checkpoint's), else of
    its config and weight files. A LoRA run records its base's, and refuses another."""
    names = [MANIFEST]
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        names = sorted(n for n in os.listdir(path)
                       if n == 'config.json' or n.endswith('.safetensors'))
    digest = hashlib.sha256()
    for name in names:
        digest.update(fingerprint(os.path.join(path, name))[1].encode())
    return digest.hexdigest()


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
    base = lora_base(ckpt, lora['base_model_name_or_path']) if lora else ckpt
    model = Transformer.from_pretrained(base).to(device).eval()
    if lora:
        add_lora(model.layers, lora['r'], lora['lora_alpha'], lora['target_modules'])
        load_adapters(model.layers, adapter_weights(ckpt), ckpt)
    if packed and model.config.bitnet and not model.config.packed:
        model.freeze()
    return ckpt, model, tokenizer or tokenizer_of(ckpt) or 'bytes'


def lora_base(ckpt, base):
    """The base a LoRA checkpoint's adapters adapt, verified as any checkpoint (find) and,
    where its training state recorded the base's identity, the very one they were
    trained on."""
    base = find(base)
    state = os.path.join(ckpt, STATE)
    recorded = read_state(state).get('base_identity') if os.path.isfile(state) else None
    check_base(ckpt, base, recorded)
    return base


def check_base(ckpt, base, recorded):
    """A ValueError when the base model at `base` is not the one whose identity a LoRA
    checkpoint recorded (None: nothing recorded, nothing to compare)."""
    if recorded and identity(base) != recorded:
        raise ValueError(f"{ckpt} adapts {base} as it was when the adapters were trained, "
                         f"and its files have changed since; restore that base, or train "
                         f"the adapters anew on this one")


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
        if os.path.islink(tmp):  # a link would send the save into its target
            os.unlink(tmp)
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


# ---------------------------------------------------------------- the run's log

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
