"""
Checkpoints: how a run's state is written so that none is ever half, and how every script
finds the newest good one.

A checkpoint `out/ckpt_0000750/` is a Hugging Face directory (config.json, model.safetensors,
the tokenizer files; transformers opens it; with LoRA, PEFT's adapter files instead) plus
train_state.pt, everything else a resume needs (optimizer, scaler, RNG of every rank, data
position, best val loss, the config). It is written under a temporary name (`.tmp_ckpt_*`) and
renamed when complete, so a crash during a save never leaves a broken newest checkpoint. Last
comes manifest.json, the size and sha256 of every file: a disk can still cut or flip bytes
later, and the manifest is how a reader tells. A failed write (a full disk) removes its
temporary directory and says in one line which checkpoint is intact.

`find` is the one way train.py (resume, init_from, a teacher), sample.py and bench.py find a
checkpoint: a run's folder gives its newest intact one, a damaged one falling back to the one
before it with a warning; a checkpoint named directly is verified; a hub id is downloaded.
"""
import errno
import hashlib
import json
import os
import shutil
import sys

import torch
from safetensors import SafetensorError

from hub import TOKENIZER_FILES, resolve_model

STATE = 'train_state.pt'
MANIFEST = 'manifest.json'


def checkpoints(folder):
    """Complete checkpoints in a run's folder, oldest first (saves in progress are .tmp_ckpt_*)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(os.path.join(folder, n) for n in names if n.startswith('ckpt_'))


def fingerprint(path):
    """[size, sha256] of a file: what manifest.json records for each file of a checkpoint."""
    with open(path, 'rb') as f:
        return [os.fstat(f.fileno()).st_size, hashlib.file_digest(f, 'sha256').hexdigest()]


def damage(ckpt):
    """What is wrong with a checkpoint, or None when every file its manifest.json names has the
    size and sha256 recorded there."""
    try:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            manifest = json.load(f)
        for name, recorded in manifest.items():
            if fingerprint(os.path.join(ckpt, name)) != recorded:
                return f"{name} is damaged (its size or sha256 is not the one in {MANIFEST})"
    except (OSError, ValueError, TypeError) as e:
        return f"no readable {MANIFEST} ({type(e).__name__}: {e})"
    return None


def latest(folder, set_aside=False, warn=True):
    """The newest intact checkpoint of a run's folder. A damaged one is skipped with a one-line
    warning (unless not `warn`: a rank other than 0) and, with set_aside (the run that will write
    new ones), renamed damaged_ckpt_* (not deleted), so that the next saves cannot count it."""
    for ckpt in reversed(checkpoints(folder)):
        problem = damage(ckpt)
        if problem is None:
            return ckpt
        name = os.path.basename(ckpt)
        note = "falling back to the checkpoint before it"
        if set_aside:
            os.replace(ckpt, os.path.join(folder, 'damaged_' + name))
            note = f"renamed to damaged_{name}, " + note
        if warn:
            print(f"warning: {ckpt}: {problem}; {note}", file=sys.stderr)
    raise FileNotFoundError(f"no intact checkpoint left in {folder!r}")


def is_model_dir(path):
    return any(os.path.exists(os.path.join(path, f)) for f in ('config.json', 'adapter_config.json'))


def find(src, set_aside=False):
    """A checkpoint directory to load from `src`: a run's folder (its newest intact checkpoint),
    a checkpoint or Hugging Face directory (verified when it has a manifest), or a hub id
    (downloaded). Raises an OSError or ValueError whose message says what is wrong."""
    if os.path.isdir(src) and not is_model_dir(src):
        if not checkpoints(src):
            raise FileNotFoundError(f"no checkpoint in {src!r}; train one with python train.py "
                                    f"or name a checkpoint directory")
        return latest(src, set_aside)
    path = resolve_model(src)
    if os.path.exists(os.path.join(path, MANIFEST)):
        problem = damage(path)
        if problem:
            raise ValueError(f"cannot read {path}: {problem}; name an intact checkpoint, or the "
                             f"run's folder to take its newest intact one")
    return path


def copy_tokenizer(tokenizer_file, dest):
    """The tokenizer.json (and its chat template files beside it) go with the weights."""
    shutil.copy(tokenizer_file, os.path.join(dest, 'tokenizer.json'))
    for extra in TOKENIZER_FILES[1:]:
        found = os.path.join(os.path.dirname(tokenizer_file), extra)
        if os.path.exists(found):
            shutil.copy(found, dest)


def save(folder, step, write_weights, state, tokenizer_file=None, keep=2, best_step=None):
    """Write checkpoint `step` of a run into folder: write_weights(directory) writes the Hugging
    Face part, `state` goes to train_state.pt, the manifest last, then the rename. Then all but
    the newest `keep` and the best are removed. Returns None, or why the write failed (earlier
    checkpoints are then untouched and no temporary directory is left)."""
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
        manifest = {name: fingerprint(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), 'w') as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except (OSError, RuntimeError, SafetensorError) as e:
        # torch.save reports a full disk as "unexpected pos"; the free space tells what happened
        full = getattr(e, 'errno', None) == errno.ENOSPC or shutil.disk_usage(folder).free < 2**20
        shutil.rmtree(tmp, ignore_errors=True)
        cause = 'no space left on device' if full else f"{type(e).__name__}: {e}".splitlines()[0]
        kept = f"the last complete one, {prev[0]}, is intact" if prev else "no earlier one exists"
        return (f"cannot write checkpoint {final} ({cause}); {kept}. Free space in {folder} "
                f"(or set --out_dir), then continue with --init_from=resume")
    best = os.path.join(folder, f'ckpt_{best_step:07d}') if best_step is not None else None
    for old in checkpoints(folder)[:-keep]:
        if old != best:
            shutil.rmtree(old)
    print(f"saved {final}")
    return None
