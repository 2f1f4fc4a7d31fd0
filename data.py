"""
Data: tokenizers, downloads, token shards, the loader and its mixtures, the offline corpus.

Tokenizers. Every tokenizer here is a `tiktoken.Encoding`: tiktoken is a fast BPE encoder
written in Rust, and every byte-level BPE (GPT-2, cl100k, Llama 3, SmolLM2) fits its three
parts: a regex that cuts text into pieces, merge ranks, and special tokens. A Hugging Face
tokenizer.json holds the same three things in another dress: its vocabulary spells bytes as
printable characters (GPT-2's byte-to-unicode table, undone below), its merges come in the
order of their ids (so an id is a rank), and its pre-tokenizer is a regex. The offline
encoding is the degenerate case: no merges, one token per byte.

Downloads are plain HTTPS GETs of hub files, `{endpoint}/{repo}/resolve/{revision}/{file}`:
redirects followed, a cut transfer resumed with a Range header, the file written under a
temporary name and renamed once it matches the sha256 the hub sends for large files. Under DDP only
local rank 0 downloads; the other ranks wait for the file to appear.

Token shards use llm.c's format, so modded-nanogpt's FineWeb shards load as they are: a
header of 256 int32 (magic 20240520, version, token count), then the tokens. Version 1
holds uint16 tokens (vocabularies up to 65536); version 2, ours, holds uint32 tokens. A chat
(SFT) shard `train_000000.bin` has its loss mask beside it in `train_000000.mask`: the same
header with version 3, then one uint8 per token, 1 where the token is an assistant's. Every
document starts with the end-of-text token (EOS), as in llm.c, so that in a packed window a
new document reads "after EOS" the way it would read after a BOS.

The loader cuts shards into windows of block_size + 1 tokens and walks them in an order that
depends only on (seed, epoch): shards shuffled, windows shuffled within each shard, rank r
of N keeping every N-th window, so the ranks see disjoint data. Its state is that position
(plus the mixture weights), so a resumed run sees exactly the batches it would have seen.
Several sources mix by weights; influence-based remixing scores each source by the cosine
between its gradient and the val gradient (to first order, a step on a source lowers the
val loss in proportion to their dot product) and moves weight toward the helpful ones.

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
import sys
import time
from collections import deque

import numpy as np
import requests
import tiktoken
import torch

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2's: every digit its own piece, then GPT-2's regex on the stretches between digits.
# A stretch ends at a digit, so whitespace before a digit stays whole: \s+(?=\p{N}).
DIGITS_PATTERN = r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
# Llama 3's (and cl100k's): numbers in runs of up to 3 digits, case-insensitive contractions
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ('<|endoftext|>', '<|mask|>', '<|im_start|>', '<|im_end|>')
EOS_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>')
IGNORE = -100  # a target that does not count: F.cross_entropy's ignore_index, as in objectives.py


def byte_encoding():
    """256 byte tokens, then the special tokens: a tokenizer that needs no download."""
    return tiktoken.Encoding(name='bytes', pat_str=GPT2_PATTERN,
                             mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})


def byte_alphabet():
    """GPT-2's byte -> character table: printable bytes stay themselves, the rest (control
    characters, space, ...) move to chr(256 + n), so that every token is printable text."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def pre_tokenizer_pattern(pre, unsupported):
    """The one regex that cuts text like a tokenizer.json pre-tokenizer, for the three
    layouts in use: ByteLevel (GPT-2), Digits + ByteLevel (SmolLM2), Split + ByteLevel (Llama 3)."""
    steps = (pre.get('pretokenizers') if pre.get('type') == 'Sequence' else [pre]) if pre else []
    kinds, last = tuple(s['type'] for s in steps), steps[-1] if steps else {}
    if kinds[-1:] == ('ByteLevel',) and not last.get('add_prefix_space'):
        regex, first = last.get('use_regex', True), steps[0]
        if kinds == ('ByteLevel',) and regex:
            return GPT2_PATTERN
        if kinds == ('Digits', 'ByteLevel') and regex and first.get('individual_digits'):
            return DIGITS_PATTERN
        if (kinds == ('Split', 'ByteLevel') and not regex and first.get('behavior') == 'Isolated'
                and not first.get('invert') and 'Regex' in first['pattern']):
            return first['pattern']['Regex']
    raise ValueError(f"{unsupported}; its pre-tokenizer is {' + '.join(kinds) or 'none'}")


def hf_encoding(path):
    """A Hugging Face byte-level BPE tokenizer.json as a tiktoken Encoding with the same ids."""
    with open(path, encoding='utf-8') as f:
        tj = json.load(f)
    model = tj.get('model', {})
    unsupported = (f"{path}: only a byte-level BPE tokenizer.json (GPT-2, Llama 3, SmolLM2 style) "
                   f"can be converted; use one of those, a tiktoken name or 'bytes'")
    if model.get('type') != 'BPE' or tj.get('normalizer') or model.get('byte_fallback') or model.get('continuing_subword_prefix'):
        raise ValueError(f"{unsupported}; this one is {model.get('type')} with normalizer {(tj.get('normalizer') or {}).get('type')}")
    pattern = pre_tokenizer_pattern(tj.get('pre_tokenizer'), unsupported)
    added = {t['content']: t['id'] for t in tj.get('added_tokens', [])}
    byte = {c: b for b, c in byte_alphabet().items()}
    try:
        ranks = {bytes(byte[c] for c in t): i for t, i in model['vocab'].items() if t not in added}
    except KeyError:
        raise ValueError(f"{unsupported}; its vocabulary is not byte-level") from None
    # tiktoken merges the adjacent pair whose concatenation has the lowest id; that is the
    # BPE of the merge list when later merges make larger ids, which is how BPE is trained
    merged = [model['vocab'][''.join(m.split(' ') if isinstance(m, str) else m)] for m in model['merges']]
    if any(a > b for a, b in zip(merged, merged[1:])):
        raise ValueError(f"{unsupported}; its merges are not in the order of their ids")
    return tiktoken.Encoding(os.path.abspath(path), pat_str=pattern, mergeable_ranks=ranks, special_tokens=added)


def get_tokenizer(name):
    """'bytes' (offline), a tiktoken name ('gpt2', 'cl100k_base', 'o200k_base'), a Hugging Face
    tokenizer.json or a directory holding one, or a hub model id (its tokenizer.json is fetched)."""
    if name == 'bytes':
        return byte_encoding()
    if name in tiktoken.list_encoding_names():
        try:
            return tiktoken.get_encoding(name)
        except requests.RequestException as e:  # tiktoken fetches its files once, then caches them
            raise DownloadError(f"tiktoken cannot fetch {name!r} ({type(e).__name__}); connect once"
                                f", or set TIKTOKEN_CACHE_DIR to a folder with its files") from None
    path = os.path.join(name, 'tokenizer.json') if os.path.isdir(name) else name
    if os.path.isfile(path):
        return hf_encoding(path)
    if re.fullmatch(r'[\w.-]+/[\w.-]+', name):
        return hf_encoding(hub_download(name, 'tokenizer.json'))
    raise ValueError(f"unknown tokenizer {name!r}; use 'bytes', a tokenizer.json (or its folder), "
                     f"a hub model id or one of {tiktoken.list_encoding_names()}")


def same_encoding(a, b):
    """Whether two tokenizers give the same ids on a probe of text, digits, code and unicode."""
    probe = 'The year 2024: def f(x):\n\treturn x ** 2  # naïve café, 東京 🚀' * 2
    return a.n_vocab == b.n_vocab and a.special_tokens_set == b.special_tokens_set and \
        a.encode_ordinary(probe) == b.encode_ordinary(probe)


def eos_id(enc):
    """The end-of-text token that starts (and so separates) documents."""
    for name in EOS_NAMES:
        if name in enc.special_tokens_set:
            return enc.encode_single_token(name)
    raise ValueError(f"tokenizer {enc.name!r} has no end-of-text token {EOS_NAMES}; use another")



# the names under which llama.cpp (src/llama-vocab.cpp) runs each pre-tokenizer regex above
LLAMA_CPP_PRE = {GPT2_PATTERN: 'gpt-2', DIGITS_PATTERN: 'smollm', LLAMA3_PATTERN: 'llama-bpe'}


def gguf_vocab(enc, vocab_size):
    """The tokenizer as the GGUF keys of llama.cpp's 'gpt2' BPE: each token spelled in GPT-2's byte
    alphabet with its type (1 normal, 3 control: a special token, 5 unused: padding rows up to
    vocab_size), the merges in rank order, and the pre-tokenizer's name. tiktoken keeps ranks, not
    merges: the merge that makes a token is the last step of BPE on its bytes."""
    if enc._pat_str not in LLAMA_CPP_PRE:
        raise ValueError(f"tokenizer {enc.name!r}: llama.cpp has no pre-tokenizer for its regex; "
                         f"use a GPT-2, SmolLM2 or Llama 3 style tokenizer")
    glyph, special = byte_alphabet(), {enc.encode_single_token(s) for s in enc.special_tokens_set}
    pieces = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
    ranks = {p: i for i, p in enumerate(pieces) if i not in special}
    spell = lambda b: ''.join(glyph[c] for c in b)
    types = [5 if i >= enc.n_vocab else 3 if i in special else 1 for i in range(vocab_size)]
    tokens = [f'[PAD{i}]' if t == 5 else pieces[i].decode() if t == 3 else spell(pieces[i])
              for i, t in enumerate(types)]
    merges = []
    for token in ranks:  # in id order, which is rank order
        segs = [token[i:i + 1] for i in range(len(token))]
        while len(segs) > 2:  # merge the lowest-ranked pair, as tiktoken does
            i = min(range(len(segs) - 1), key=lambda j: ranks.get(segs[j] + segs[j + 1], math.inf))
            segs[i:i + 2] = [segs[i] + segs[i + 1]]
        if len(segs) == 2:
            merges.append(spell(segs[0]) + ' ' + spell(segs[1]))
    return {'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': LLAMA_CPP_PRE[enc._pat_str],
            'tokenizer.ggml.tokens': tokens, 'tokenizer.ggml.token_type': types,
            'tokenizer.ggml.merges': merges, 'tokenizer.ggml.add_bos_token': False}


# -----------------------------------------------------------------------------
# downloads

class Progress:
    """One progress line for long work (downloads, preparing data, evaluation): rewritten in place
    on a terminal, a new line every `every` seconds otherwise, so that logs stay readable; nothing
    for work that ends within `delay` seconds. Amounts are in `unit`s of `scale` (MB: 1e6)."""

    def __init__(self, what, total=0, unit=' MB', scale=1e6, start=0, delay=2.0, every=10.0):
        self.what, self.total, self.unit, self.scale, self.start = what, total, unit, scale, start
        self.tty, self.every = sys.stdout.isatty(), every
        self.t0, self.shown, self.delay = time.time(), 0.0, delay

    def __call__(self, done, extra='', last=False):
        now = time.time()
        if now - self.t0 < self.delay or not last and now - self.shown < (0.5 if self.tty else self.every):
            return
        self.shown, rate, f = now, (done - self.start) / (now - self.t0), ',.1f' if self.scale > 1 else ',.0f'
        line = f"{self.what}: {done / self.scale:{f}}{f' / {self.total / self.scale:{f}}' if self.total else ''}" \
               f"{self.unit}{extra}, {rate / self.scale:,.1f}{self.unit}/s"
        if self.total and not last and rate > 0:
            line += f", ETA {(self.total - done) / rate:.0f}s"
        print(f"\r{line}\033[K" if self.tty else line, end='\n' if last or not self.tty else '', flush=True)


class DownloadError(OSError):
    """A file that cannot be fetched; `status` is the HTTP status when there was one."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def cache_dir():
    return os.environ.get('NANOBITNET_CACHE') or os.path.expanduser('~/.cache/nanobitnet')


def local_rank():
    return int(os.environ.get('LOCAL_RANK', 0))  # set by torchrun before torch.distributed is up


def wait_for(path, what, timeout):
    """The other local ranks wait for rank 0's result to appear: a file renamed into place."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for local rank 0 to {what}; see its error")
        time.sleep(0.2)
    return path


def download(url, dest, timeout=60, wait=3600, tries=3):
    """Fetch url to dest once (a file already there is kept); returns dest."""
    if os.path.exists(dest):
        return dest
    if local_rank() != 0:
        return wait_for(dest, f"download {url}", wait)
    local = "or download it yourself and pass its local path"
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('0', ''):
        raise DownloadError(f"{url} is not at {dest} and HF_HUB_OFFLINE is set; unset it, {local}")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part, auth = dest + '.part', {'Authorization': f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get('HF_TOKEN') else {}
    for attempt in range(tries):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        try:
            with requests.get(url, headers={**auth, 'Range': f'bytes={have}-'} if have else auth,
                              stream=True, timeout=timeout) as r:
                # the hub names an LFS file's sha256 in X-Linked-Etag (on the redirect) or ETag
                tags = [h.headers.get(k, '').strip('W/"') for h in (*r.history, r) for k in ('X-Linked-Etag', 'ETag')]
                sha = next((t for t in tags if re.fullmatch('[0-9a-f]{64}', t)), None)
                code = r.status_code
                if code in (401, 403):
                    raise DownloadError(f"{url}: HTTP {code}, not authorized; gated/private repo? "
                                        f"set HF_TOKEN to a token that can read it, {local}", code)
                if code == 404:
                    raise DownloadError(f"{url}: HTTP 404, not found; check the repo id, revision and file name, {local}", 404)
                if code == 416:
                    break  # the part already holds the whole file: a crash came before the rename
                if code >= 400:
                    raise DownloadError(f"{url}: HTTP {code}; try again later, {local}", code)
                have = have if code == 206 else 0  # 200: the server ignored the Range
                show = Progress(f"download {os.path.basename(dest)}", have + int(r.headers.get('Content-Length', 0)),
                                start=have)
                with open(part, 'ab' if have else 'wb') as f:
                    for chunk in r.iter_content(1 << 16):
                        f.write(chunk)
                        have += len(chunk)
                        show(have)
                show(have, last=True)
            break
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            err = type(e).__name__  # a cut transfer: the next try resumes from what arrived
            time.sleep(attempt)
    else:
        raise DownloadError(f"cannot download {url} ({err}); check network, HF_ENDPOINT, {local}")
    if sha:
        with open(part, 'rb') as f:
            got = hashlib.file_digest(f, 'sha256').hexdigest()
        if got != sha:
            os.remove(part)
            raise DownloadError(f"{url}: sha256 {got[:16]}... is not the hub's {sha[:16]}...; "
                                f"the corrupt file was deleted, run again")
    os.replace(part, dest)
    return dest


def hub_url(repo_id, filename, repo_type='model', revision='main'):
    endpoint = os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')
    return f"{endpoint}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}/resolve/{revision}/{filename}"


def hub_download(repo_id, filename, repo_type='model', revision='main'):
    """A file of a hub repo (model or dataset), cached under cache_dir()."""
    dest = os.path.join(cache_dir(), repo_type + 's', repo_id, revision, filename)
    return download(hub_url(repo_id, filename, repo_type, revision), dest)


def fetch(src, folder=None):
    """A data file given as a local path, a URL, or hf://datasets/owner/name[@revision]/file
    (hf://owner/name/file for a model repo): its local path, downloaded (into folder) if need be."""
    m = re.fullmatch(r'hf://(datasets/)?([^/@]+/[^/@]+)(?:@([^/]+))?/(.+)', src)
    if m:
        kind, repo, revision, name = 'dataset' if m[1] else 'model', m[2], m[3] or 'main', m[4]
        url, dest = hub_url(repo, name, kind, revision), os.path.join(cache_dir(), kind + 's', repo, revision, name)
    elif src.startswith(('http://', 'https://')):
        url, dest = src, os.path.join(cache_dir(), 'urls', re.sub(r'[^\w.-]', '_', src.split('://', 1)[1]))
    elif os.path.exists(src):
        return src
    else:
        raise FileNotFoundError(f"data file {src!r} not found; give a local path, an https:// URL or hf://datasets/owner/name/file")
    return download(url, os.path.join(folder, os.path.basename(dest)) if folder else dest)


def resolve_model(src, revision='main'):
    """A Hugging Face model directory: src itself if it is one, else the hub repo src fetched into
    the cache (config.json, the safetensors weights, single or sharded, the tokenizer files)."""
    if os.path.isdir(src):
        return src
    if not re.fullmatch(r'[\w.-]+/[\w.-]+', src):
        raise FileNotFoundError(f"{src!r} is neither a model directory nor a hub id (owner/name)")
    folder = os.path.join(cache_dir(), 'models', src, revision)
    done = os.path.join(folder, '.complete')  # which files exist is known only to rank 0
    if os.path.exists(done) or local_rank() != 0:
        wait_for(done, f"download {src}", 3600)
        return folder

    def get(name, optional=False):
        try:
            return hub_download(src, name, 'model', revision)
        except DownloadError as e:
            if not (optional and e.status == 404):
                raise

    get('config.json')
    index = get('model.safetensors.index.json', optional=True)
    if index:
        with open(index) as f:
            weights = sorted(set(json.load(f)['weight_map'].values()))
    for name in weights if index else ['model.safetensors']:
        get(name)
    for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
        get(name, optional=True)
    open(done, 'w').close()
    return folder


# -----------------------------------------------------------------------------
# token shards

MAGIC, HEADER = 20240520, 256
DTYPES = {1: np.uint16, 2: np.uint32, 3: np.uint8}  # llm.c's tokens, tokens >= 65536, a loss mask


def write_shard(path, values, version):
    header = np.zeros(HEADER, np.int32)
    header[:3] = MAGIC, version, len(values)
    with open(path + '.tmp', 'wb') as f:
        f.write(header.tobytes())
        f.write(np.asarray(values, DTYPES[version]).tobytes())
    os.replace(path + '.tmp', path)


def read_shard(path):
    """A shard's tokens (or mask) as a read-only memmap: nothing is read until it is used."""
    header = np.fromfile(path, np.int32, HEADER)
    if len(header) < 3 or header[0] != MAGIC or header[1] not in DTYPES:
        raise ValueError(f"{path} is not a token shard (llm.c format: magic {MAGIC}, version 1-3); prepare it with data.prepare")
    dtype, n = DTYPES[int(header[1])], int(header[2])
    if os.path.getsize(path) != 4 * HEADER + n * np.dtype(dtype).itemsize:
        raise ValueError(f"{path} does not hold the {n} tokens its header announces; download or prepare it again")
    return np.memmap(path, dtype, 'r', offset=4 * HEADER, shape=(n,))


def shard_paths(folder, split):
    """A split's shards: ours (train_000000.bin) or llm.c's (fineweb_train_000001.bin)."""
    return sorted(glob.glob(os.path.join(folder, f'*{split}_*.bin')))


# -----------------------------------------------------------------------------
# preparing text, jsonl and chat jsonl into shards

# (turn start, after the role, turn end, after the turn); the first one whose special tokens exist
CHAT_TEMPLATES = (('<|im_start|>', '\n', '<|im_end|>', '\n'),  # ChatML: SmolLM2, Qwen, 'bytes'
                  ('<|start_header_id|>', '<|end_header_id|>\n\n', '<|eot_id|>', ''))  # Llama 3
ROLES = {'human': 'user', 'gpt': 'assistant'}  # ShareGPT's names
UNIT = 1 << 18  # characters of text per work unit sent to a tokenizing process
# where a long text may be cut, since every pre-tokenizer above cuts there too: a newline
# between a non-space and a letter (after a space, "  \n" would split as "  " + "\n")
CUT = re.compile(r'(?<=\S)\n(?=[A-Za-z])')


def chat_template(enc):
    for template in CHAT_TEMPLATES:
        if set(re.findall(r'<\|\w+\|>', ''.join(template))) <= enc.special_tokens_set:
            return template
    raise ValueError(f"tokenizer {enc.name!r} has no chat tokens (ChatML's <|im_start|> <|im_end|> "
                     f"or Llama 3's headers); use 'bytes' or a tokenizer that has them")


def chat_turns(row):
    """(role, text) pairs from the three common layouts of a chat jsonl line."""
    if 'messages' in row:
        return [(m['role'], m['content']) for m in row['messages']]
    if 'conversations' in row:  # ShareGPT
        return [(ROLES.get(m['from'], m['from']), m['value']) for m in row['conversations']]
    if 'prompt' in row and 'response' in row:
        return [('user', row['prompt']), ('assistant', row['response'])]
    raise ValueError(f"a chat line needs 'messages', 'conversations' or 'prompt' and 'response'; this one has {sorted(row)}")


def render_chat(enc, turns, template=None):
    """One conversation as tokens and a loss mask that is 1 exactly on the assistant's text
    and on the token that ends its turn (so that the model learns to stop). In ChatML, with
    the counted tokens in brackets:
        <|endoftext|><|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n[Hello!<|im_end|>]\\n
    The texts are encoded as ordinary text, so no one can smuggle in special tokens, but together
    with the plain end of their header ("assistant\\n"), as HF's chat templates tokenize the
    rendered text: an answer that starts with whitespace merges with the header's newline.
    A token that holds any of the answer counts."""
    start, role_end, end, after = template or chat_template(enc)
    tokens, mask = [eos_id(enc)], [0]
    for role, text in turns:
        head = start + role + role_end  # cut goes after its last special token
        cut = max(head.rfind(s) + len(s) for s in enc.special_tokens_set if s in head)
        special, body = enc.encode(head[:cut], allowed_special='all'), enc.encode_ordinary(head[cut:] + text)
        ends = (enc.decode_with_offsets(body)[1] + [len(head) - cut + len(text)])[1:]  # token ends
        tail = [enc.encode_single_token(end)] + enc.encode_ordinary(after)
        tokens += special + body + tail
        answer = role == 'assistant'
        mask += [0] * len(special) + [int(answer and e > len(head) - cut) for e in ends] + \
            [int(answer)] + [0] * (len(tail) - 1)
    return tokens, mask


def chat_prompt(enc, text):
    """A user's message and the assistant's header: what a chat model answers from."""
    start, role_end, _, _ = chat_template(enc)
    return render_chat(enc, [('user', text)])[0] + enc.encode(start + 'assistant' + role_end, allowed_special='all')


def _start_worker(tokenizer, fmt, field):
    global _job
    enc = get_tokenizer(tokenizer)
    _job = enc, fmt, field, eos_id(enc), chat_template(enc) if fmt == 'chat' else None


def _tokenize(unit):
    """In a worker: (split, [(starts a document, text or jsonl line)]) -> tokens (and mask)."""
    split, items = unit
    enc, fmt, field, eos, template = _job
    parts, masks = [], []
    for new, raw in items:
        if fmt == 'chat':
            tokens, mask = render_chat(enc, chat_turns(json.loads(raw)), template)
            parts.append(np.array(tokens, np.uint32))
            masks.append(np.array(mask, np.uint8))
            continue
        row = json.loads(raw) if fmt == 'jsonl' else {field: raw}
        if field not in row:
            raise ValueError(f"a jsonl line has no field {field!r} ({sorted(row)}); set text_field")
        # encode_to_numpy skips building a Python list; disallowed_special=() reads any
        # special token's text in a document as ordinary text, like encode_ordinary
        parts += [np.array([eos] * new, np.uint32), enc.encode_to_numpy(row[field], disallowed_special=())]
    tokens = np.concatenate(parts).astype(np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32)
    return split, sum(len(r) for _, r in items), tokens, np.concatenate(masks) if masks else None


def _documents(path, fmt):
    """A file's documents: jsonl lines, or text between <|endoftext|> markers (TinyStories)."""
    with open(path, encoding='utf-8') as f:
        if fmt != 'text':
            yield from (line for line in f if line.strip())
            return
        rest = ''
        while block := f.read(1 << 22):
            *docs, rest = (rest + block).split('<|endoftext|>')
            yield from (d.strip() for d in docs if d.strip())
        if rest.strip():
            yield rest.strip()


def _units(files, val_files, val_every, fmt):
    """Work units of about UNIT characters. Without val files every val_every-th document goes
    to val. A long text is cut into pieces at CUT, so that its tokens are those of the whole."""
    buffers, sizes, n = {'train': [], 'val': []}, {'train': 0, 'val': 0}, 0
    for split, path in [('train', p) for p in files] + [('val', p) for p in val_files]:
        for doc in _documents(path, fmt):
            n += 1
            s = 'val' if split == 'val' or (not val_files and n % val_every == 0) else 'train'
            pos = 0
            while fmt == 'text' and len(doc) - pos > UNIT and (cut := CUT.search(doc, pos + UNIT)):
                buffers[s].append((pos == 0, doc[pos:cut.end()]))
                pos = cut.end()
            buffers[s].append((pos == 0, doc[pos:]))
            sizes[s] += len(doc)
            if sizes[s] >= UNIT:
                yield s, buffers[s]
                buffers[s], sizes[s] = [], 0
    yield from ((s, b) for s, b in buffers.items() if b)


class _Writer:
    """Tokens (and masks) appended in order, written out as shards of `size` tokens."""

    def __init__(self, folder, split, size):
        self.folder, self.split, self.size, self.parts, self.masks, self.n, self.shards = folder, split, size, [], [], 0, 0

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


def prepare(files, folder, tokenizer='bytes', fmt='text', val_files=(), val_every=100,
            text_field='text', shard_tokens=10 ** 8, workers=None):
    """Tokenize `files` into shards folder/train_*.bin and val_*.bin (and *.mask for chats) on
    `workers` processes. fmt 'text': documents separated by <|endoftext|>; 'jsonl': one
    document per line, in text_field; 'chat': one conversation per line (messages, ShareGPT
    conversations, or prompt/response), with loss masks. The val split is val_files, or
    else every val_every-th document. Returns the token count of each split."""
    if fmt not in ('text', 'jsonl', 'chat'):
        raise ValueError(f"data format {fmt!r} unknown; use 'text', 'jsonl' or 'chat' (or 'tokens' for ready shards)")
    if shard_paths(folder, 'train') or shard_paths(folder, 'val'):  # old and new would mix
        raise FileExistsError(f"{folder} already holds token shards; delete them or use another")
    os.makedirs(folder, exist_ok=True)
    writers = {s: _Writer(folder, s, shard_tokens) for s in ('train', 'val')}
    t0, chars, jobs, workers = time.time(), 0, deque(), workers or os.cpu_count()
    show = Progress(f"prepare {folder}", sum(os.path.getsize(f) for f in [*files, *val_files]))
    # fork, not spawn: spawn would re-run the calling script (train.py has no main guard)
    with mp.get_context('fork').Pool(workers, _start_worker, (tokenizer, fmt, text_field)) as pool:
        for unit in itertools.chain(_units(files, val_files, val_every, fmt), [None]):
            if unit:  # keep a few units in flight: the workers stay busy and memory stays bounded
                jobs.append(pool.apply_async(_tokenize, (unit,)))
            while jobs and (len(jobs) > 2 * workers or unit is None):
                split, n, tokens, mask = jobs.popleft().get()
                writers[split].add(tokens, mask)
                chars += n
                show(chars, ' of text, ' + ', '.join(f"{w.shards * shard_tokens + w.n:,} {s}" for s, w in writers.items())
                     + ' tokens')
    show(chars, last=True)
    counts = {}
    for split, w in writers.items():
        counts[split] = w.shards * shard_tokens + w.n
        if w.n:
            w.write(w.n)
        if not counts[split]:
            raise ValueError(f"no {split} documents in {files + list(val_files)}; give val files or lower val_every")
    print(f"prepared {folder}: {counts['train']:,} train and {counts['val']:,} val tokens in {time.time() - t0:.0f}s")
    return counts


def setup_data(folder, files=None, tokenizer='bytes', fmt='text', text_field='text', wait=6 * 3600):
    """Make sure folder holds token shards, once: files = {'train': [...], 'val': [...]} (val
    optional; paths, URLs or hf:// names) downloaded as they are (fmt 'tokens': llm.c shards)
    or downloaded and prepared. Local rank 0 works; the other ranks wait for its marker,
    which records the tokenizer, so shards are never read with another one."""
    marker = os.path.join(folder, 'prepared.json')
    if files and not os.path.exists(marker):
        if local_rank() != 0:
            wait_for(marker, f"prepare {folder}", wait)
        else:
            listed = {s: [v] if isinstance(v, str) else list(v) for s, v in files.items()}
            train, val = listed.get('train', []), listed.get('val', [])
            if fmt == 'tokens':
                for src in train + val:
                    fetch(src, folder)
            else:
                prepare([fetch(s) for s in train], folder, tokenizer, fmt, [fetch(s) for s in val], text_field=text_field)
            with open(marker + '.tmp', 'w') as f:
                json.dump({'tokenizer': tokenizer, 'format': fmt, 'files': files}, f)
            os.replace(marker + '.tmp', marker)
    if os.path.exists(marker):
        with open(marker) as f:
            made = json.load(f)['tokenizer']
        if made != tokenizer:
            raise ValueError(f"{folder} holds tokens of tokenizer {made!r}, not {tokenizer!r}; set tokenizer={made!r} or use another folder")
    if not shard_paths(folder, 'train'):
        raise FileNotFoundError(f"no token shards (*train_*.bin) in {folder!r}; set data_files to download and prepare them")
    return folder


# -----------------------------------------------------------------------------
# the loader: seeded order, disjoint ranks, resumable state, mixtures

class _Stream:
    """One source's windows of T + 1 tokens: shards shuffled per epoch, windows shuffled
    within each shard, and rank r of N keeping windows r, r + N, ... of each shard."""

    def __init__(self, folder, split, T, rank, world_size, seed):
        self.paths = shard_paths(folder, split)
        if not self.paths:
            raise FileNotFoundError(f"no {split} shards (*{split}_*.bin) in {folder!r}; prepare the data first (data.setup_data)")
        if all((len(read_shard(p)) - 1) // T <= rank for p in self.paths):
            raise ValueError(f"{folder}: the {split} shards are too short for block_size={T} on {world_size} ranks")
        self.T, self.rank, self.world, self.seed = T, rank, world_size, seed
        self.pos, self.cache = [0, 0, 0], None  # epoch, shard, window; the shard being read

    def _shard(self):
        epoch, shard, _ = self.pos
        if self.cache is None or self.cache[0] != (epoch, shard):
            k = np.random.default_rng([self.seed, epoch]).permutation(len(self.paths))[shard]
            tokens, mask = read_shard(self.paths[k]), self.paths[k][:-4] + '.mask'
            windows = np.random.default_rng([self.seed, epoch, k]).permutation((len(tokens) - 1) // self.T)
            self.cache = (epoch, shard), tokens, read_shard(mask) if os.path.exists(mask) else None, windows[self.rank::self.world] * self.T
        return self.cache[1:]

    def take(self):
        """The next window of tokens and its loss mask (None when the source has none)."""
        while True:
            tokens, mask, starts = self._shard()
            epoch, shard, i = self.pos
            if i < len(starts):
                self.pos[2], s = i + 1, starts[i]
                return tokens[s:s + self.T + 1], None if mask is None else mask[s:s + self.T + 1]
            self.pos = [epoch + (shard + 1 == len(self.paths)), (shard + 1) % len(self.paths), 0]


class Loader:
    """Batches from one folder of shards, or from a mixture {name: (folder, weight)}; each row
    comes from a source drawn with the current weights. A batch is a dict: x, y (y = IGNORE
    where a loss mask says the target does not count) and `source` (B,). Documents are packed:
    attention crosses EOS, and the model learns that what follows EOS is a new document."""

    def __init__(self, sources, batch_size, block_size, split='train', rank=0, world_size=1, seed=0):
        sources = {'data': (sources, 1.0)} if isinstance(sources, str) else sources
        self.names = list(sources)
        self.streams = [_Stream(folder, split, block_size, rank, world_size, seed) for folder, _ in sources.values()]
        self.weights = np.array([w for _, w in sources.values()], float) / sum(w for _, w in sources.values())
        self.B, self.T, self.rank, self.seed, self.count = batch_size, block_size, rank, seed, 0

    def _batch(self, picks):
        rows = [self.streams[k].take() for k in picks]
        xy = torch.from_numpy(np.stack([t for t, _ in rows]).astype(np.int64))
        counted = torch.from_numpy(np.stack([np.ones(self.T + 1, bool) if m is None else m.astype(bool) for _, m in rows]))
        x, y = xy[:, :-1], xy[:, 1:].masked_fill(~counted[:, 1:], IGNORE)  # (B, T) each
        return {'x': x, 'y': y, 'source': torch.tensor(picks)}

    def next_batch(self):
        rng = np.random.default_rng([self.seed, self.rank, self.count])  # so no RNG state to save
        self.count += 1
        return self._batch(rng.choice(len(self.streams), self.B, p=self.weights).tolist())

    def source_batches(self):
        """One batch of each source alone, to score the sources (objectives.source_scores)."""
        return {name: self._batch([k] * self.B) for k, name in enumerate(self.names)}

    def reweight(self, scores, eta=1.0, floor=0.05):
        """Multiplicative weights: w_i <- w_i * exp(eta * score_i), normalised; a source that
        falls below `floor` is lifted to it, at the others' expense. The next batch is drawn
        with the new weights. Returns them by name, to log."""
        k = len(self.names)
        if floor * k >= 1:
            raise ValueError(f"remix floor {floor} leaves nothing to reweight among {k} sources; use less than {1 / k:.3f}")
        w = self.weights * np.exp(eta * np.array([scores[n] for n in self.names]))
        w, low = w / w.sum(), np.zeros(k, bool)
        while (new := ~low & (w < floor)).any():
            low |= new
            w = np.where(low, floor, w * (1 - floor * low.sum()) / w[~low].sum())
        self.weights = w
        return dict(zip(self.names, w.tolist()))

    def state_dict(self):
        return {'count': self.count, 'weights': self.weights.tolist(), 'pos': [list(s.pos) for s in self.streams]}

    def load_state_dict(self, state):
        self.count, self.weights = state['count'], np.array(state['weights'])
        for s, pos in zip(self.streams, state['pos']):
            s.pos, s.cache = list(pos), None


# -----------------------------------------------------------------------------
# the offline corpus

def offline_corpus(enc, val_fraction=0.1):
    """The pydoc topics, each followed by end-of-text, as (train, val) uint16/32 token arrays."""
    from pydoc_data.topics import topics
    tokens = []
    for key in sorted(topics):
        tokens += enc.encode_ordinary(topics[key]) + [eos_id(enc)]
    tokens = np.array(tokens, dtype=np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    n = int(len(tokens) * (1 - val_fraction))
    return tokens[:n], tokens[n:]


def get_batch(data, batch_size, block_size, generator):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token targets y."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator).tolist()
    xy = torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64))
    return xy[:, :-1], xy[:, 1:]  # (B, T) each
