"""
Data: tokenizers, the offline default corpus, and batches.

The tokenizer is always a `tiktoken.Encoding`: tiktoken is a fast BPE encoder written in
Rust, and every byte-level BPE (GPT-2, cl100k, a Hugging Face tokenizer.json) fits its three
parts: a regex that splits text into pieces, a table of merge ranks, and special tokens.
The offline encoding below is the degenerate case: no merges, so one token per byte.

The offline default corpus is the text of the Python standard library's documentation
(`pydoc_data.topics`, about 465 KB of English with code), which ships with every Python,
so `python train.py` needs no download.
"""
import numpy as np
import tiktoken
import torch

# GPT-2's pre-tokenizer: contractions, words, numbers, punctuation runs, whitespace
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ('<|endoftext|>', '<|mask|>', '<|im_start|>', '<|im_end|>')


def byte_encoding():
    """256 byte tokens, then the special tokens: a tokenizer that needs no download."""
    return tiktoken.Encoding(name='bytes', pat_str=GPT2_PATTERN,
                             mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})


def get_tokenizer(name):
    """'bytes' (offline), or a tiktoken encoding name such as 'gpt2' or 'cl100k_base'."""
    if name == 'bytes':
        return byte_encoding()
    try:
        return tiktoken.get_encoding(name)
    except ValueError:
        raise ValueError(f"unknown tokenizer {name!r}; use 'bytes' or one of {tiktoken.list_encoding_names()}") from None


def offline_corpus(enc, val_fraction=0.1):
    """The pydoc topics, each followed by end-of-text, as (train, val) uint16/uint32 token arrays."""
    from pydoc_data.topics import topics
    tokens = []
    for key in sorted(topics):
        tokens += enc.encode_ordinary(topics[key]) + [enc.eot_token]
    tokens = np.array(tokens, dtype=np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    n = int(len(tokens) * (1 - val_fraction))
    return tokens[:n], tokens[n:]


def get_batch(data, batch_size, block_size, generator):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token targets y."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator).tolist()
    xy = torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64))
    return xy[:, :-1], xy[:, 1:]  # (B, T) each
