"""
Data: token shards, preparing them from text, jsonl, chats and preferences, the loader
and its mixtures, and the offline corpus.

Token shards use llm.c's format, so modded-nanogpt's FineWeb shards load as they are: a
header of 256 int32 (magic 20240520, version, token count), then the tokens. Version 1
holds uint16 tokens (vocabularies up to 65536); version 2, ours, holds uint32 tokens. A
chat (SFT) shard `train_000000.bin` has its loss mask beside it in `train_000000.mask`:
the same header with version 3, then one uint8 per token, 1 where the token is an
assistant's. Every document starts with the end-of-text token (EOS), as in llm.c, so
that in a packed window a new document reads "after EOS" the way it would read after a
BOS.

The loader cuts shards into windows of block_size + 1 tokens and walks them in an order
that depends only on (seed, epoch): shards shuffled, windows shuffled within each shard,
rank r of N keeping every N-th window, so the ranks see disjoint data. Its state is that
position (plus the mixture weights), so a resumed run sees exactly the batches it would
have seen. Several sources mix by weights; influence-based remixing scores each source
by the cosine between its gradient and the val gradient (to first order, a step on a
source lowers the val loss in proportion to their dot product) and moves weight toward
the helpful ones.

The offline default corpus is the text of the Python standard library's documentation
(`pydoc_data.topics`, about 465 KB of English with code), which ships with every Python,
so `python train.py` needs no download.
"""
import glob
import hashlib
import itertools
import json
import math
import multiprocessing as mp
import os
import re
import time
from collections import deque

import numpy as np
import torch

from hub import fetch, local_rank, wait_for
from report import Progress
from tokenizer import chat_template, chat_turns, eos_id, get_tokenizer, render_chat

IGNORE = -100  # a target that does not count: F.cross_entropy's ignore_index
# the roles render_chat draws as headers and that chat templates know; any other would be
# drawn just the same, and a misnamed assistant ('bot') would leave nothing to learn
CHAT_ROLES = ('system', 'user', 'assistant')


# -----------------------------------------------------------------------------
# token shards

MAGIC, HEADER = 20240520, 256
# by version: llm.c's tokens, tokens >= 65536, a loss mask
DTYPES = {1: np.uint16, 2: np.uint32, 3: np.uint8}


def write_shard(path, values, version):
    header = np.zeros(HEADER, np.int32)
    header[:3] = MAGIC, version, len(values)
    with open(path + '.tmp', 'wb') as f:
        f.write(header.tobytes())
        f.write(np.asarray(values, DTYPES[version]).tobytes())
    os.replace(path + '.tmp', path)


def read_shard(path):
    """A shard's tokens (or mask) as a read-only memmap: nothing is read until it is
    used."""
    header = np.fromfile(path, np.int32, HEADER)
    if len(header) < 3 or header[0] != MAGIC or header[1] not in DTYPES:
        raise ValueError(f"{path} is not a token shard (llm.c format: magic {MAGIC}, "
                         f"version 1-3); prepare it with data.prepare")
    dtype, n = DTYPES[int(header[1])], int(header[2])
    if os.path.getsize(path) != 4 * HEADER + n * np.dtype(dtype).itemsize:
        raise ValueError(f"{path} does not hold the {n} tokens its header announces; "
                         f"download or prepare it again")
    return np.memmap(path, dtype, 'r', offset=4 * HEADER, shape=(n,))


def shard_paths(folder, split):
    """A split's shards: ours (train_000000.bin) or llm.c's
    (fineweb_train_000001.bin)."""
    return sorted(glob.glob(os.path.join(folder, f'*{split}_*.bin')))


# -----------------------------------------------------------------------------
# preparing text, jsonl and chat jsonl into shards

UNIT = 1 << 18  # characters of text per work unit sent to a tokenizing process
# where a long text may be cut, since every pre-tokenizer in tokenizer.py cuts there too:
# a newline between a non-space and a letter (after a space, "  \n" would split as
# "  " + "\n")
CUT = re.compile(r'(?<=\S)\n(?=[A-Za-z])')


def _start_worker(tokenizer, fmt, field):
    global _job
    enc = get_tokenizer(tokenizer)
    _job = enc, fmt, field, eos_id(enc), chat_template(enc) if fmt == 'chat' else None


def _row(raw, where, layout):
    """A jsonl line as the JSON object it must be."""
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e}); fix or delete that line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a JSON object but {raw.strip()[:40]}; "
                         f"write each line as {layout}")
    return row


def _text(raw, where, field):
    """A jsonl line's text, in its field `field`."""
    row = _row(raw, where, f'{{"{field}": "..."}}')
    if field not in row:
        raise ValueError(f"{where} has no field {field!r} ({sorted(row)}); set prepare.text_field")
    if not isinstance(row[field], str):
        raise ValueError(f"{where}: field {field!r} is not text but "
                         f"{json.dumps(row[field])[:40]}; write the text there")
    return row[field]


def _turns(raw, where):
    """A chat line's (role, text) turns, checked here, where the line is known."""
    row = _row(raw, where, '{"messages": [{"role": "user", "content": "..."}, ...]}')
    try:
        turns = chat_turns(row)
    except (KeyError, TypeError):
        raise ValueError(f"{where}: a message needs 'role' and 'content' (ShareGPT: 'from' "
                         f"and 'value'); fix that line") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for role, text in turns:
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}: role {role!r} is not one of {', '.join(CHAT_ROLES)}; "
                             f"rename it (ShareGPT's human and gpt are read as user and "
                             f"assistant)")
        if not isinstance(text, str):
            raise ValueError(f"{where}: a {role} message is not text but "
                             f"{json.dumps(text)[:40]}; write the text there")
    return turns


def _tokenize(unit):
    """In a worker: (split, [(where, starts a document, text or jsonl line)]) -> tokens
    (and mask)."""
    split, items = unit
    enc, fmt, field, eos, template = _job
    parts, masks = [], []
    for where, new, raw in items:
        if fmt == 'chat':
            tokens, mask = render_chat(enc, _turns(raw, where), template)
            parts.append(np.array(tokens, np.uint32))
            masks.append(np.array(mask, np.uint8))
            continue
        text = _text(raw, where, field) if fmt == 'jsonl' else raw
        # encode_to_numpy skips building a Python list; disallowed_special=() reads any
        # special token's text in a document as ordinary text, like encode_ordinary
        doc_start = np.array([eos] * new, np.uint32)
        ids = enc.encode_to_numpy(text, disallowed_special=())
        parts += [doc_start, ids]
    dtype = np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32
    tokens = np.concatenate(parts).astype(dtype)
    chars = sum(len(r) for _, _, r in items)
    mask = np.concatenate(masks) if masks else None
    return split, chars, tokens, mask


def documents(path, fmt):
    """A file's documents: jsonl lines, or text between <|endoftext|> markers
    (TinyStories); each with where it is (a jsonl line by its number), for the error a
    bad one ends in."""
    with open(path, encoding='utf-8') as f:
        if fmt != 'text':
            numbered = enumerate(f, 1)
            yield from ((f"{path} line {n}", line) for n, line in numbered if line.strip())
            return
        rest = ''
        while block := f.read(1 << 22):
            *docs, rest = (rest + block).split('<|endoftext|>')
            yield from ((path, d.strip()) for d in docs if d.strip())
        if rest.strip():
            yield path, rest.strip()


def _units(files, val_files, val_every, fmt, unit):
    """Work units of about `unit` characters. Without val files every val_every-th
    document goes to val. A long text is cut into pieces at CUT, so that its tokens are
    those of the whole."""
    buffers, sizes, n = {'train': [], 'val': []}, {'train': 0, 'val': 0}, 0
    for split, path in [('train', p) for p in files] + [('val', p) for p in val_files]:
        for where, doc in documents(path, fmt):
            n += 1
            to_val = split == 'val' or (not val_files and n % val_every == 0)
            s = 'val' if to_val else 'train'
            pos = 0
            while (fmt == 'text' and len(doc) - pos > unit
                   and (cut := CUT.search(doc, pos + unit))):
                buffers[s].append((where, pos == 0, doc[pos:cut.end()]))
                pos = cut.end()
            buffers[s].append((where, pos == 0, doc[pos:]))
            sizes[s] += len(doc)
            if sizes[s] >= unit:
                yield s, buffers[s]
                buffers[s], sizes[s] = [], 0
    yield from ((s, b) for s, b in buffers.items() if b)


class _Writer:
    """Tokens (and masks) appended in order, written out as shards of `size` tokens."""

    def __init__(self, folder, split, size):
        self.folder = folder
        self.split = split
        self.size = size
        self.parts = []
        self.masks = []
        self.n = 0
        self.shards = 0

    def add(self, tokens, mask):
        self.parts.append(tokens)
        self.masks.append(mask)
        self.n += len(tokens)
        while self.n >= self.size:
            self.write(self.size)

    def write(self, n):
        tokens = np.concatenate(self.parts)
        path = os.path.join(self.folder, f'{self.split}_{self.shards:06d}.bin')
        write_shard(path, tokens[:n], 1 if tokens.dtype == np.uint16 else 2)
        if self.masks[0] is not None:
            mask = np.concatenate(self.masks)
            write_shard(path[:-4] + '.mask', mask[:n], 3)
            self.masks = [mask[n:]]
        self.parts, self.n, self.shards = [tokens[n:]], self.n - n, self.shards + 1


def write_documents(folder, documents, tokenizer, masks=None, shard_tokens=10 ** 8):
    """Documents already tokenized ({'train': [...], 'val': [...]}, each a list of ids
    that starts with <|endoftext|>, as prepare starts them) as the shards prepare
    writes, with its marker, so that train.py reads them as any prepared folder
    (dataset=folder, the same tokenizer); `masks` in the same shape (1 where a token
    is a target) writes their loss masks, as prepare's chat rows have. Returns the
    token count of each split."""
    if shard_paths(folder, 'train') or shard_paths(folder, 'val'):
        raise FileExistsError(f"{folder} already holds token shards; "
                              f"delete them or use another")
    os.makedirs(folder, exist_ok=True)
    dtype = np.uint16 if get_tokenizer(tokenizer).n_vocab <= 1 << 16 else np.uint32
    counts = {}
    for split, docs in documents.items():
        writer = _Writer(folder, split, shard_tokens)
        for i, doc in enumerate(docs):
            mask = None if masks is None else np.array(masks[split][i], np.uint8)
            writer.add(np.array(doc, dtype), mask)
        counts[split] = writer.shards * shard_tokens + writer.n
        if writer.n:
            writer.write(writer.n)
    marker = os.path.join(folder, 'prepared.json')
    with open(marker + '.tmp', 'w') as f:
        json.dump({'tokenizer': tokenizer, 'format': 'generated'}, f)
    os.replace(marker + '.tmp', marker)
    return counts


def _stop(pool):
    """Let the workers finish their units and exit. Left to `with`, terminate() can
    kill a worker while the pool's own thread still sends it its stop signal, and then
    wait on that thread for ever (CPython issue 96995). Not on Ctrl-C: the workers got
    it too, their units are lost, and join() would wait for them; `with` kills them."""
    pool.close()
    pool.join()


def prepare(files, folder, tokenizer='bytes', fmt='text', val_files=(), val_every=100,
            text_field='text', shard_tokens=10 ** 8, workers=None, unit=UNIT):
    """Tokenize `files` into shards folder/train_*.bin and val_*.bin (and *.mask for
    chats) on `workers` processes. fmt 'text': documents separated by <|endoftext|>;
    'jsonl': one document per line, in text_field; 'chat': one conversation per line
    (messages, ShareGPT conversations, or prompt/response), with loss masks. The val
    split is val_files, or else every val_every-th document. Work goes to the processes
    in units of `unit` characters. Returns the token count of each split."""
    if fmt not in ('text', 'jsonl', 'chat'):
        raise ValueError(f"data format {fmt!r} unknown; use 'text', 'jsonl' or 'chat' "
                         f"(or 'tokens' for ready shards)")
    # old and new would mix
    if shard_paths(folder, 'train') or shard_paths(folder, 'val'):
        raise FileExistsError(f"{folder} already holds token shards; "
                              f"delete them or use another")
    os.makedirs(folder, exist_ok=True)
    writers = {s: _Writer(folder, s, shard_tokens) for s in ('train', 'val')}
    t0 = time.time()
    chars = 0
    jobs = deque()
    workers = workers or os.cpu_count()
    size = sum(os.path.getsize(f) for f in [*files, *val_files])
    show = Progress(f"prepare {folder}", size)
    # fork, not spawn: spawn would re-run the calling script (train.py has no main guard)
    ctx = mp.get_context('fork')
    with ctx.Pool(workers, _start_worker, (tokenizer, fmt, text_field)) as pool:
        units = _units(files, val_files, val_every, fmt, unit)
        try:
            # keep a few units in flight: the workers stay busy and memory stays bounded
            for work in itertools.chain(units, [None]):
                if work:
                    jobs.append(pool.apply_async(_tokenize, (work,)))
                while jobs and (len(jobs) > 2 * workers or work is None):
                    split, n, tokens, mask = jobs.popleft().get()
                    writers[split].add(tokens, mask)
                    chars += n
                    done = ', '.join(f"{w.shards * shard_tokens + w.n:,} {s}"
                                     for s, w in writers.items())
                    show(chars, ' of text, ' + done + ' tokens')
        except Exception:
            _stop(pool)
            raise
        _stop(pool)
    show(chars, last=True)
    counts = {}
    for split, w in writers.items():
        counts[split] = w.shards * shard_tokens + w.n
        if w.n:
            w.write(w.n)
        if not counts[split]:
            raise ValueError(f"no {split} documents in {files + list(val_files)}; "
                             f"give val files or lower val_every")
    print(f"prepared {folder}: {counts['train']:,} train and {counts['val']:,} val "
          f"tokens in {time.time() - t0:.0f}s")
    return counts


def setup_data(folder, files=None, tokenizer='bytes', fmt='text', text_field='text',
               wait=6 * 3600, n_vocab=None, tokenizer_file=None, named=()):
    """Make sure folder holds token shards, once: files = {'train': [...], 'val': [...]}
    (val optional; paths, URLs or hf:// names) downloaded as they are (fmt 'tokens':
    llm.c shards) or downloaded and prepared. Local rank 0 works; the other ranks wait
    for its marker, which records the tokenizer (its name, and the sha256 of its
    tokenizer_file when it has one), so shards are never read with another one: a
    tokenizer of another name is the same one only when both files are byte for byte
    the same (a run's checkpoint carries a copy of its model's tokenizer.json). Given
    n_vocab, shards that hold an id past it are refused. Each function of `named` turns
    the names it knows into the paths of the files they name, made then, and any other
    path into itself (train.py's: the offline tasks' files), so that naming one in a
    config makes nothing until a run prepares the folder."""
    marker = os.path.join(folder, 'prepared.json')
    if files and not os.path.exists(marker):
        if local_rank() != 0:
            wait_for(marker, f"prepare {folder}", wait)
        else:
            listed = {s: [v] if isinstance(v, str) else list(v)
                      for s, v in files.items()}
            for name_to_path in named:
                listed = {s: list(map(name_to_path, v)) for s, v in listed.items()}
            train, val = listed.get('train', []), listed.get('val', [])
            if fmt == 'tokens':
                for src in train + val:
                    fetch(src, folder)
            else:
                train_files = [fetch(s) for s in train]
                val_files = [fetch(s) for s in val]
                prepare(train_files, folder, tokenizer, fmt, val_files,
                        text_field=text_field)
            made = {'tokenizer': tokenizer, 'format': fmt, 'files': files,
                    'max_id': largest_id(folder)}
            if tokenizer_file:
                made['tokenizer_sha256'] = file_sha256(tokenizer_file)
            write_marker(marker, made)
    made = {}
    if os.path.exists(marker):
        made = read_marker(marker)
        same_file = (tokenizer_file and 'tokenizer_sha256' in made
                     and made['tokenizer_sha256'] == file_sha256(tokenizer_file))
        if made['tokenizer'] != tokenizer and not same_file:
            raise ValueError(f"{folder} holds tokens of tokenizer {made['tokenizer']!r}, "
                             f"not {tokenizer!r}; set tokenizer={made['tokenizer']!r} "
                             f"or use another folder")
    if not shard_paths(folder, 'train'):
        raise FileNotFoundError(f"no token shards (*train_*.bin) in {folder!r}; "
                                f"set prepare.files to download and prepare them")
    # an id past the vocabulary (n_vocab, the tokenizer's) would index past the embedding,
    # mid-run: read each shard once (a marker keeps the result with the shards' sizes and
    # times, read again when they change; shards without one are read at every start)
    stamp = shard_stamp(folder)
    top = made.get('max_id') if made.get('shards') == stamp else None
    if top is None:
        top = largest_id(folder)
        if made and local_rank() == 0:
            write_marker(marker, {**made, 'max_id': top, 'shards': stamp})
    if n_vocab and top >= n_vocab:
        raise ValueError(f"{folder} holds token id {top}, past the {n_vocab} ids of "
                         f"tokenizer {tokenizer!r}; prepare the shards with it again")
    return folder


def file_sha256(path):
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


def shard_stamp(folder):
    """{shard file: [size, modification time in ns]} of a folder's train and val shards:
    what a largest id kept in its marker was read from."""
    shards = shard_paths(folder, 'train') + shard_paths(folder, 'val')
    stats = {os.path.basename(p): os.stat(p) for p in shards}
    return {name: [s.st_size, s.st_mtime_ns] for name, s in stats.items()}


def largest_id(folder):
    """The largest token id in a folder's train and val shards."""
    shards = shard_paths(folder, 'train') + shard_paths(folder, 'val')
    return max((int(read_shard(p).max(initial=0)) for p in shards), default=0)


def read_marker(marker):
    """A folder's prepared.json, checked: an object naming its tokenizer (a string) and,
    where it keeps one, its largest id (an integer). A ValueError otherwise."""
    try:
        with open(marker) as f:
            made = json.load(f)
    except ValueError:
        made = None
    top = made.get('max_id') if isinstance(made, dict) else None
    if not (isinstance(made, dict) and isinstance(made.get('tokenizer'), str)
            and (top is None or type(top) is int)):
        raise ValueError(f"{marker} is no marker prepare wrote (an object with the tokenizer's "
                         f"name and an integer max_id); prepare the folder again")
    return made


def write_marker(marker, made):
    with open(marker + '.tmp', 'w') as f:
        json.dump(made, f)
    os.replace(marker + '.tmp', marker)


# -----------------------------------------------------------------------------
# the loader: seeded order, disjoint ranks, resumable state, mixtures

class _Stream:
    """One source's windows of T + 1 tokens: shards shuffled per epoch, windows shuffled
    within each shard, and rank r of N keeping windows r, r + N, ... of each shard."""

    def __init__(self, folder, split, T, rank, world_size, seed):
        self.paths = shard_paths(folder, split)
        if not self.paths:
            raise FileNotFoundError(f"no {split} shards (*{split}_*.bin) in {folder!r}; "
                                    f"prepare the data first (data.setup_data)")
        if all((len(read_shard(p)) - 1) // T <= rank for p in self.paths):
            raise ValueError(f"{folder}: the {split} shards are too short for "
                             f"block_size={T} on {world_size} ranks")
        self.T = T
        self.rank = rank
        self.world = world_size
        self.seed = seed
        self.pos = [0, 0, 0]  # epoch, shard, window
        self.cache = None  # the shard being read

    def _shard(self):
        epoch, shard, _ = self.pos
        if self.cache is None or self.cache[0] != (epoch, shard):
            rng = np.random.default_rng([self.seed, epoch])
            k = rng.permutation(len(self.paths))[shard]
            path = self.paths[k]
            tokens = read_shard(path)
            rng = np.random.default_rng([self.seed, epoch, k])
            windows = rng.permutation((len(tokens) - 1) // self.T)
            mask_path = path[:-4] + '.mask'
            mask = read_shard(mask_path) if os.path.exists(mask_path) else None
            starts = windows[self.rank::self.world] * self.T
            self.cache = (epoch, shard), tokens, mask, starts
        return self.cache[1:]

    def take(self):
        """The next window of tokens and its loss mask (None when the source has
        none)."""
        while True:
            tokens, mask, starts = self._shard()
            epoch, shard, i = self.pos
            if i < len(starts):
                self.pos[2], s = i + 1, starts[i]
                end = s + self.T + 1
                return tokens[s:end], None if mask is None else mask[s:end]
            last = shard + 1 == len(self.paths)
            self.pos = [epoch + last, (shard + 1) % len(self.paths), 0]


class Loader:
    """Batches from one folder of shards, or from a mixture {name: (folder, weight)};
    each row comes from a source drawn with the current weights. A batch is a dict: x, y
    (y = IGNORE where a loss mask says the target does not count) and `source` (B,).
    Documents are packed: attention crosses EOS, and the model learns that what follows
    EOS is a new document."""

    def __init__(self, sources, batch_size, block_size, split='train', rank=0,
                 world_size=1, seed=0):
        sources = {'data': (sources, 1.0)} if isinstance(sources, str) else sources
        self.names = list(sources)
        self.streams = [_Stream(folder, split, block_size, rank, world_size, seed)
                        for folder, _ in sources.values()]
        weights = np.array([w for _, w in sources.values()], float)
        self.weights = weights / sum(w for _, w in sources.values())
        self.B = batch_size
        self.T = block_size
        self.rank = rank
        self.seed = seed
        self.count = 0

    def _batch(self, picks):
        rows = [self.streams[k].take() for k in picks]
        xy = torch.from_numpy(np.stack([t for t, _ in rows]).astype(np.int64))
        masks = [np.ones(self.T + 1, bool) if m is None else m.astype(bool)
                 for _, m in rows]
        counted = torch.from_numpy(np.stack(masks))
        x, y = xy[:, :-1], xy[:, 1:].masked_fill(~counted[:, 1:], IGNORE)  # (B, T) each
        return {'x': x, 'y': y, 'source': torch.tensor(picks)}

    def next_batch(self):
        # seeded by the batch count, so there is no RNG state to save
        rng = np.random.default_rng([self.seed, self.rank, self.count])
        self.count += 1
        picks = rng.choice(len(self.streams), self.B, p=self.weights).tolist()
        return self._batch(picks)

    def source_batches(self):
        """One batch of each source alone, to score the sources
        (optim.source_scores)."""
        return {name: self._batch([k] * self.B) for k, name in enumerate(self.names)}

    def reweight(self, scores, eta=1.0, floor=0.05):
        """Multiplicative weights: w_i <- w_i * exp(eta * score_i), normalised; a source
        that falls below `floor` is lifted to it, at the others' expense. The next batch
        is drawn with the new weights. Returns them by name, to log."""
        k = len(self.names)
        if floor * k >= 1:
            raise ValueError(f"remix floor {floor} leaves nothing to reweight among {k} "
                             f"sources; use less than {1 / k:.3f}")
        w = self.weights * np.exp(eta * np.array([scores[n] for n in self.names]))
        w, low = w / w.sum(), np.zeros(k, bool)
        while (new := ~low & (w < floor)).any():
            low |= new
            w = np.where(low, floor, w * (1 - floor * low.sum()) / w[~low].sum())
        self.weights = w
        return dict(zip(self.names, w.tolist()))

    def state_dict(self):
        return {'count': self.count, 'weights': self.weights.tolist(),
                'pos': [list(s.pos) for s in self.streams]}

    def load_state_dict(self, state):
        self.count, self.weights = state['count'], np.array(state['weights'])
        for s, pos in zip(self.streams, state['pos']):
            s.pos, s.cache = list(pos), None


# -----------------------------------------------------------------------------
# the offline corpus

def offline_corpus(enc, val_fraction=0.1):
    """The pydoc topics, each followed by end-of-text, as (train, val) uint16/32 token
    arrays."""
    from pydoc_data.topics import topics
    tokens = []
    for key in sorted(topics):
        tokens += enc.encode_ordinary(topics[key]) + [eos_id(enc)]
    tokens = np.array(tokens, dtype=np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    n = int(len(tokens) * (1 - val_fraction))
    return tokens[:n], tokens[n:]


def get_batch(data, batch_size, block_size, generator):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token
    targets y."""
    high = len(data) - block_size - 1
    ix = torch.randint(high, (batch_size,), generator=generator).tolist()
    windows = np.stack([data[i:i + block_size + 1] for i in ix])
    xy = torch.from_numpy(windows.astype(np.int64))
    return xy[:, :-1], xy[:, 1:]  # (B, T) each


class Batches:
    """What each rank trains on at each step, the same on any number of ranks and after
    a resume. A step's global batch is cut into micro-batches; rank r of N takes number
    index = micro * N + r. From the offline corpus (token arrays): random windows drawn
    by a generator seeded by (seed, step, index), so there is no state to keep. From
    token shards (a folder, or a mixture {name: (folder, weight)}): a Loader, whose place
    checkpoints keep. DPO's preference pairs are drawn by the same generator."""

    def __init__(self, train, val, batch_size, block_size, rank=0, world_size=1, seed=0,
                 pairs=None, device='cpu'):
        self.train, self.val = train, val
        self.B, self.T = batch_size, block_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.pairs, self.device = pairs, device
        self.loader = None
        if isinstance(train, (str, dict)):
            self.loader = self.new_loader()

    def new_loader(self):
        """A loader of the training shards at the start of its order."""
        return Loader(self.train, self.B, self.T, 'train', self.rank, self.world_size,
                      self.seed)

    def get(self, step, micro, data=None):
        """This rank's micro-batch `micro` of optimizer step `step`: {'x', 'y'} on the
        device (and DPO's 'pairs'); `data` another token array to draw from."""
        index = micro * self.world_size + self.rank
        seed = (self.seed * 1_000_003 + step) * 65_537 + index
        rng = torch.Generator().manual_seed(seed)
        if data is None and self.loader:
            b = self.loader.next_batch()
        else:
            source = self.train if data is None else data
            x, y = get_batch(source, self.B, self.T, rng)
            b = {'x': x, 'y': y}
        b = {k: b[k].to(self.device, non_blocking=True) for k in 'xy'}
        if self.pairs:
            i = torch.randint(len(self.pairs[0]), (self.B,), generator=rng)
            b['pairs'] = tuple(t[i].to(self.device) for t in self.pairs)
        return b

    def calibration(self, n):
        """The inputs of n training batches to calibrate SubLN on; the run's stay put."""
        if not self.loader:
            return [self.get(0, i)['x'] for i in range(n)]
        loader = self.new_loader()
        return [loader.next_batch()['x'].to(self.device) for _ in range(n)]

    def val_batches(self, n):
        """The same n val batches at every evaluation."""
        if not self.loader:
            return [self.get(-1, i, self.val) for i in range(n)]
        val = Loader(self.val, self.B, self.T, 'val', self.rank, self.world_size,
                     self.seed)
        batches = []
        for _ in range(n):
            b = val.next_batch()
            batches.append({'x': b['x'].to(self.device), 'y': b['y'].to(self.device)})
        return batches


# -----------------------------------------------------------------------------
# preference pairs (DPO)

def preference_pairs(path, enc, block_size, eos):
    """A jsonl of {"prompt", "chosen", "rejected"} as DPO's pairs: four (N, block_size)
    tensors x_w, y_w, x_l, y_l. Each sequence starts with eos (as every document does)
    and the prompt, and the answer follows, ending with eos; the targets of the prompt
    and of the padding are IGNORE."""
    rows = []
    layout = '{"prompt": "...", "chosen": "...", "rejected": "..."}'
    with open(path) as f:
        for n, line in enumerate(f, 1):
            ex = _row(line, f"{path} line {n}", layout)
            prompt = [eos] + enc.encode_ordinary(ex['prompt'])
            if len(prompt) >= block_size:
                raise ValueError(f"{path} line {n}: a prompt of {len(prompt)} tokens "
                                 f"leaves no room for an answer "
                                 f"in block_size={block_size}; "
                                 f"shorten it or raise block_size")
            for answer in (ex['chosen'], ex['rejected']):
                ids = (prompt + enc.encode_ordinary(answer) + [eos])[:block_size + 1]
                x, y = torch.full((block_size,), eos), torch.full((block_size,), IGNORE)
                x[:len(ids) - 1] = torch.tensor(ids[:-1])
                y[len(prompt) - 1:len(ids) - 1] = torch.tensor(ids[len(prompt):])
                rows.append((x, y))
    x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    return x[0::2], y[0::2], x[1::2], y[1::2]


def run_data(dataset, prepare, mixture, remix_interval, enc, tokenizer_name, tokenizer_file,
             dpo_data='', block_size=128, named=()):
    """(train data, val data, preference pairs or None) of a train.py run: the token
    shards of `dataset` (made once from prepare's files, format and text field; ids
    checked against enc's vocabulary), trained on through `mixture` when one is named,
    or else the offline corpus; DPO's pairs when dpo_data names a file. `named`: as
    setup_data takes it."""
    if (mixture and not dataset) or (remix_interval and not mixture):
        raise ValueError("mixture= needs dataset= (whose val split is evaluated); "
                         "remix.interval needs mixture=")
    for name, source in mixture.items():
        pair = isinstance(source, (tuple, list)) and len(source) == 2
        weight = source[1] if pair else None
        number = type(weight) in (int, float) and math.isfinite(weight) and weight > 0
        if not (pair and isinstance(source[0], str) and number):
            raise ValueError(f"mixture {name!r}: {source!r} is no (folder, weight above 0) "
                             f"pair; write mixture={{{name!r}: ('data/x', 1.0), ...}}")
    if dataset:
        setup_data(dataset, prepare['files'], tokenizer_name, prepare['format'],
                   prepare['text_field'], n_vocab=enc.n_vocab, tokenizer_file=tokenizer_file,
                   named=named)
        for folder, _ in (mixture or {}).values():  # its tokenizer and ids checked too
            setup_data(folder, None, tokenizer_name, n_vocab=enc.n_vocab,
                       tokenizer_file=tokenizer_file)
        train_data, val_data = mixture or dataset, dataset
        # the val split, first read at the first evaluation: refused now if it cannot be
        Loader(val_data, 1, block_size, 'val')
    else:
        train_data, val_data = offline_corpus(enc)
    pairs = None
    if dpo_data:
        pairs = preference_pairs(dpo_data, enc, block_size, eos_id(enc))
    return train_data, val_data, pairs
