"""
Tokenizers, all as `tiktoken.Encoding`s, and chat rendering.

tiktoken is a fast BPE encoder written in Rust, and every byte-level BPE (GPT-2,
cl100k, Llama 3, SmolLM2) fits its three parts: a regex that cuts text into pieces, merge
ranks, and special tokens. A Hugging Face tokenizer.json holds the same three things in
another dress: its vocabulary spells bytes as printable characters (GPT-2's
byte-to-unicode table, undone below), its merges come in the order of their ids (so an
id is a rank), and its pre-tokenizer is a regex. Qwen's also put text in Unicode's NFC
form first (NFCEncoding). The offline encoding 'bytes' is the degenerate case: no merges,
one token per byte.

Chats are rendered in the tokenizer's own template (ChatML, or Llama 3's headers) with a
loss mask that is 1 on the assistant's tokens only, the way SFT trains.
"""
import json
import os
import re
import unicodedata

import requests
import tiktoken

from hub import DownloadError, hub_download

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|"""
                r"""\s+(?!\S)|\s+""")
# SmolLM2's: every digit its own piece, then GPT-2's regex on the stretches between
# digits. A stretch ends at a digit, so whitespace before a digit stays whole:
# \s+(?=\p{N}).
DIGITS_PATTERN = (r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|"""
                  r"""\s+(?=\p{N})|\s+(?!\S)|\s+""")
# Llama 3's (and cl100k's): numbers in runs of up to 3 digits, case-insensitive
# contractions
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                  r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's, Qwen2.5's and Qwen3's: Llama 3's with every digit its own piece
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                 r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# text a tokenizer.json's regex must cut before it is used: words, digits, runs of
# spaces and of one letter (where a regex that backtracks badly gives up)
PROBE = "Hello, world! It's 2026-11-28:\n\n\tdef f(x):  return x ** 2  # é ß 中文 " + 'a' * 64
SPECIAL_TOKENS = ('<|endoftext|>', '<|mask|>', '<|im_start|>', '<|im_end|>')
EOS_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>')


def byte_encoding():
    """256 byte tokens, then the special tokens: a tokenizer that needs no download."""
    ranks = {bytes([i]): i for i in range(256)}
    special = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name='bytes', pat_str=GPT2_PATTERN,
                             mergeable_ranks=ranks, special_tokens=special)


def byte_alphabet():
    """GPT-2's byte -> character table: printable bytes stay themselves, the rest
    (control characters, space, ...) move to chr(256 + n), so that every token is
    printable text."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    kept = {b: chr(b) for b in keep}
    shifted = {b: chr(256 + n) for n, b in enumerate(moved)}
    return {**kept, **shifted}


class NFCEncoding(tiktoken.Encoding):
    """An Encoding that puts text in NFC form before it encodes, as a tokenizer.json
    with an NFC normalizer does (a character and its combining accent become the one
    composed character). Decoding gives the normalized text."""

    def encode_ordinary(self, text):
        return super().encode_ordinary(unicodedata.normalize('NFC', text))

    def encode(self, text, **kwargs):
        return super().encode(unicodedata.normalize('NFC', text), **kwargs)

    def encode_to_numpy(self, text, **kwargs):
        return super().encode_to_numpy(unicodedata.normalize('NFC', text), **kwargs)


def pre_tokenizer_pattern(pre, unsupported):
    """The one regex that cuts text like a tokenizer.json pre-tokenizer, for the three
    layouts in use: ByteLevel (GPT-2), Digits + ByteLevel (SmolLM2), Split + ByteLevel
    (Llama 3)."""
    steps = []
    if pre:
        steps = pre.get('pretokenizers') if pre.get('type') == 'Sequence' else [pre]
    kinds = tuple(s['type'] for s in steps)
    last = steps[-1] if steps else {}
    if kinds[-1:] == ('ByteLevel',) and not last.get('add_prefix_space'):
        regex, first = last.get('use_regex', True), steps[0]
        if kinds == ('ByteLevel',) and regex:
            return GPT2_PATTERN
        if kinds == ('Digits', 'ByteLevel') and regex and first.get('individual_digits'):
            return DIGITS_PATTERN
        isolated = first.get('behavior') == 'Isolated' and not first.get('invert')
        split = kinds == ('Split', 'ByteLevel') and not regex and isolated
        if split and 'Regex' in first['pattern']:
            return first['pattern']['Regex']
    names = ' + '.join(kinds) or 'none'
    raise ValueError(f"{unsupported}; its pre-tokenizer is {names}")


def hf_encoding(path):
    """A Hugging Face byte-level BPE tokenizer.json as a tiktoken Encoding with the same
    ids."""
    with open(path, encoding='utf-8') as f:
        tj = json.load(f)
    unsupported = (f"{path}: only a byte-level BPE tokenizer.json "
                   f"(GPT-2, Llama 3, SmolLM2, Qwen style) can be converted; "
                   f"use one of those, a tiktoken name or 'bytes'")
    if not isinstance(tj, dict) or not isinstance(tj.get('model', {}), dict):
        raise ValueError(f"{unsupported}; this one is no JSON object with a 'model'")
    model = tj.get('model', {})
    normalizer = tj.get('normalizer')
    nfc = normalizer == {'type': 'NFC'}
    prefixed = model.get('byte_fallback') or model.get('continuing_subword_prefix')
    if model.get('type') != 'BPE' or (normalizer and not nfc) or prefixed:
        raise ValueError(f"{unsupported}; this one is {model.get('type')} "
                         f"with normalizer {(normalizer or {}).get('type')}")
    pattern = pre_tokenizer_pattern(tj.get('pre_tokenizer'), unsupported)
    vocab, merges, listed = model.get('vocab'), model.get('merges'), tj.get('added_tokens', [])
    ids = isinstance(vocab, dict) and all(type(i) is int for i in vocab.values())
    tokens = isinstance(listed, list) and all(
        isinstance(t, dict) and isinstance(t.get('content'), str) and type(t.get('id')) is int
        for t in listed)
    if not (ids and isinstance(merges, list) and tokens):
        raise ValueError(f"{unsupported}; its vocab (text to integer ids), merges (a list) "
                         f"or added_tokens (content and integer id) are of another shape")
    added = {t['content']: t['id'] for t in listed}
    byte = {c: b for b, c in byte_alphabet().items()}
    try:
        ranks = {bytes(byte[c] for c in t): i
                 for t, i in model['vocab'].items() if t not in added}
    except KeyError:
        raise ValueError(f"{unsupported}; its vocabulary is not byte-level") from None
    # tiktoken merges the adjacent pair whose concatenation has the lowest id; that is
    # the BPE of the merge list when later merges make larger ids, which is how BPE is
    # trained
    merged = []
    for m in merges:  # "a b" (older files) or ["a", "b"]
        parts = m.split(' ') if isinstance(m, str) else m
        pair = isinstance(parts, list) and len(parts) == 2
        if not pair or not all(isinstance(p, str) for p in parts) or ''.join(parts) not in vocab:
            raise ValueError(f"{unsupported}; its merge {m!r} is not two tokens whose join "
                             f"is in its vocab")
        merged.append(vocab[''.join(parts)])
    if any(a > b for a, b in zip(merged, merged[1:])):
        raise ValueError(f"{unsupported}; its merges are not in the order of their ids")
    kind = NFCEncoding if nfc else tiktoken.Encoding
    try:
        enc = kind(os.path.abspath(path), pat_str=pattern, mergeable_ranks=ranks,
                   special_tokens=added)
        enc.encode_ordinary(PROBE)
    except BaseException as e:  # a regex that backtracks too far panics in Rust
        if not isinstance(e, ValueError) and type(e).__name__ != 'PanicException':
            raise
        raise ValueError(f"{path}: its pre-tokenizer regex fails ({str(e)[:80]}); "
                         "use the tokenizer.json its model was trained with") from None
    return enc


def get_tokenizer(name):
    """'bytes' (offline), a tiktoken name ('gpt2', 'cl100k_base', 'o200k_base'), a
    Hugging Face tokenizer.json or a directory holding one, or a hub model id (its
    tokenizer.json is fetched)."""
    if name == 'bytes':
        return byte_encoding()
    if name in tiktoken.list_encoding_names():
        # tiktoken fetches its files once, then caches them
        try:
            return tiktoken.get_encoding(name)
        except requests.RequestException as e:
            raise DownloadError(f"tiktoken cannot fetch {name!r} ({type(e).__name__}); "
                                f"connect once, or set TIKTOKEN_CACHE_DIR to a folder "
                                f"with its files") from None
    path = os.path.join(name, 'tokenizer.json') if os.path.isdir(name) else name
    if os.path.isfile(path):
        return hf_encoding(path)
    if re.fullmatch(r'[\w.-]+/[\w.-]+', name):
        return hf_encoding(hub_download(name, 'tokenizer.json'))
    names = tiktoken.list_encoding_names()
    raise ValueError(f"unknown tokenizer {name!r}; use 'bytes', a tokenizer.json "
                     f"(or its folder), a hub model id or one of {names}")


def same_encoding(a, b):
    """Whether two tokenizers give the same ids on a probe of text, digits, code and
    unicode."""
    probe = 'The year 2024: def f(x):\n\treturn x ** 2  # naïve café, 東京 🚀' * 2
    if a.n_vocab != b.n_vocab or a.special_tokens_set != b.special_tokens_set:
        return False
    return a.encode_ordinary(probe) == b.encode_ordinary(probe)


def run_tokenizer(own=None, saved='', wanted=''):
    """The tokenizer a training run uses: (encoding, name, its tokenizer.json or None).
    A resumed run keeps the one it `saved`; else the one `wanted`, which must encode as
    the starting model's `own` (checkpoint.tokenizer_of); else that own one; else 'bytes'.
    Raises ValueError when wanted and own disagree."""
    name = saved or wanted or own or 'bytes'
    enc = get_tokenizer(name)
    if own and name != own and not same_encoding(enc, get_tokenizer(own)):
        raise ValueError(f"tokenizer {wanted!r} does not encode as the model's own "
                         f"({own}); leave tokenizer unset")
    path = os.path.join(name, 'tokenizer.json')  # checkpoints carry it
    if not os.path.isfile(path):
        path = name if os.path.isfile(name) else None
    return enc, name, path


def eos_id(enc):
    """The end-of-text token that starts (and so separates) documents."""
    for name in EOS_NAMES:
        if name in enc.special_tokens_set:
            return enc.encode_single_token(name)
    raise ValueError(f"tokenizer {enc.name!r} has no end-of-text token {EOS_NAMES}; "
                     f"use another")


# ---------------------------------------------------------------- chats

# (turn start, after the role, turn end, after the turn); the first one whose special
# tokens exist
CHAT_TEMPLATES = (
    ('<|im_start|>', '\n', '<|im_end|>', '\n'),  # ChatML: SmolLM2, Qwen, 'bytes'
    ('<|start_header_id|>', '<|end_header_id|>\n\n', '<|eot_id|>', ''),  # Llama 3
)
ROLES = {'human': 'user', 'gpt': 'assistant'}  # ShareGPT's names


def chat_template(enc):
    for template in CHAT_TEMPLATES:
        if set(re.findall(r'<\|\w+\|>', ''.join(template))) <= enc.special_tokens_set:
            return template
    raise ValueError(f"tokenizer {enc.name!r} has no chat tokens (ChatML's <|im_start|> "
                     f"<|im_end|> or Llama 3's headers); use 'bytes' or a tokenizer "
                     f"that has them")


def chat_template_text(folder):
    """The Jinja chat template a Hugging Face model directory holds (chat_template.jinja, or
    tokenizer_config.json's), or None."""
    jinja = os.path.join(folder, 'chat_template.jinja')
    if os.path.exists(jinja):
        return open(jinja).read()
    config = os.path.join(folder, 'tokenizer_config.json')
    if os.path.exists(config):
        template = json.load(open(config)).get('chat_template')
        return template if isinstance(template, str) else None
    return None


def chat_turns(row):
    """(role, text) pairs from the three common layouts of a chat jsonl line; a
    ValueError, saying what it holds, for anything else."""
    if not isinstance(row, dict):
        raise ValueError(f"a chat line is a JSON object, not {type(row).__name__}")
    if 'messages' in row:
        turns = [(m.get('role'), m.get('content')) for m in listed(row, 'messages')]
    elif 'conversations' in row:  # ShareGPT
        turns = [(m.get('from'), m.get('value')) for m in listed(row, 'conversations')]
        turns = [(ROLES.get(r, r) if isinstance(r, str) else r, text) for r, text in turns]
    elif 'prompt' in row and 'response' in row:
        turns = [('user', row['prompt']), ('assistant', row['response'])]
    else:
        raise ValueError(f"a chat line needs 'messages', 'conversations' or 'prompt' and "
                         f"'response'; this one has {sorted(row)}")
    if not all(isinstance(role, str) and isinstance(text, str) for role, text in turns):
        raise ValueError("a chat line's every turn needs a role and a text (strings)")
    return turns


def listed(row, key):
    """row[key], which must be a list of objects (a chat's turns)."""
    if not isinstance(row[key], list) or not all(isinstance(m, dict) for m in row[key]):
        raise ValueError(f"a chat line's {key!r} must be a list of objects, not "
                         f"{json.dumps(row[key])[:40]}")
    return row[key]


def render_chat(enc, turns, template=None):
    """One conversation as tokens and a loss mask that is 1 exactly on the assistant's
    text and on the token that ends its turn (so that the model learns to stop). In
    ChatML, with the counted tokens in brackets:
        <|endoftext|><|im_start|>user\\nHi<|im_end|>\\n
        <|im_start|>assistant\\n[Hello!<|im_end|>]\\n
    The texts are encoded as ordinary text, so no one can smuggle in special tokens, but
    together with the plain end of their header ("assistant\\n"), as HF's chat templates
    tokenize the rendered text: an answer that starts with whitespace merges with the
    header's newline. A token that holds any of the answer counts."""
    start, role_end, end, after = template or chat_template(enc)
    tokens, mask = [eos_id(enc)], [0]
    for role, text in turns:
        head = start + role + role_end  # cut goes after its last special token
        cut = max(head.rfind(s) + len(s) for s in enc.special_tokens_set if s in head)
        # the header's ordinary text, encoded together with the message
        plain = head[cut:]
        special = enc.encode(head[:cut], allowed_special='all')
        body = enc.encode_ordinary(plain + text)
        offsets = enc.decode_with_offsets(body)[1]
        ends = (offsets + [len(plain) + len(text)])[1:]  # token ends
        tail = [enc.encode_single_token(end)] + enc.encode_ordinary(after)
        tokens += special + body + tail
        answer = role == 'assistant'
        mask += [0] * len(special)
        mask += [int(answer and e > len(plain)) for e in ends]
        mask += [int(answer)] + [0] * (len(tail) - 1)
    return tokens, mask


def chat_prompt(enc, text):
    """A user's message (or a conversation so far, (role, text) pairs) and the
    assistant's header: what a chat model answers from."""
    turns = [('user', text)] if isinstance(text, str) else text
    start, role_end, _, _ = chat_template(enc)
    header = enc.encode(start + 'assistant' + role_end, allowed_special='all')
    return render_chat(enc, turns)[0] + header
