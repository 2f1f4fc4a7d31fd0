"""tokenizer.py against HF tokenizers; data.py: shards, prepare, SFT masks, the loader, remixing."""
import glob
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
import unicodedata

import numpy as np
import pytest
import tiktoken
import torch

import data
import hub
import optim
import tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = ["Hello world!  It's   fine.\n\n\nNew paragraph: 12345, 3.14159 and 1,000,000 ",
         "def f(x):\n    return x ** 2  # a comment\n\t\ttabs\r\n\r\n",
         "Ünïcödé, 日本語のテキスト, 한국어, Россия, 😀👍🏽, ½ ² Ⅻ ٣٤",
         "  leading and trailing   ", "x  \n5 a   123 b\n 7", "'s 'S 'LL I'M we'd", "",
         "special <|endoftext|> and <|im_start|>user\nhi<|im_end|> and <custom> inside"]


def corpus():
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)] + TEXTS * 10


def train_hf_tokenizer(kind, folder, vocab=2000):
    """A byte-level BPE trained by HF tokenizers with the pre-tokenizer of GPT-2, Llama 3 or SmolLM2."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = {
        'gpt2': pre_tokenizers.ByteLevel(add_prefix_space=False),
        'llama3': pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), behavior='isolated'),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        'smollm2': pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False)]),
        'qwen2': pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), behavior='isolated'),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])}[kind]
    if kind == 'qwen2':  # Qwen's tokenizers put text in NFC form first
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_tokens(['<custom>'])
    tok.add_special_tokens(['<|mask|>'])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, 'tokenizer.json'))
    return tok


@pytest.fixture(scope='module')
def gpt2_tok(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp('gpt2tok'))
    train_hf_tokenizer('gpt2', folder)
    return os.path.join(folder, 'tokenizer.json')


def fuzz(n, seed=0):
    rnd = random.Random(seed)
    pieces = list("aAzZ  \n\n\t\r0123456789'.,;:!?-_()[]{}<>|/\\\"é日本😀½²Ⅻ٣\u00a0\u2003") + [
        "'s", "'ll", "'T", "the", " of", "ing", "3.14", "<|endoftext|>", "<|im_end|>", "<custom>"]
    return [''.join(rnd.choice(pieces) for _ in range(rnd.randint(1, 50))) for _ in range(n)]


# -----------------------------------------------------------------------------
# tokenizers

@pytest.mark.parametrize('kind', ['gpt2', 'llama3', 'smollm2', 'qwen2'])
def test_hf_tokenizer_json_matches_hf_tokenizers(kind, tmp_path):
    hf = train_hf_tokenizer(kind, str(tmp_path))
    for name in (str(tmp_path), str(tmp_path / 'tokenizer.json')):  # a directory or the file
        enc = tokenizer.get_tokenizer(name)
        assert isinstance(enc, tiktoken.Encoding) and enc.n_vocab == hf.get_vocab_size()
    merged = 0
    decomposed = ['cafe\u0301 na\u0308ive \u212b', 'e\u0301' * 5]  # NFC composes these (Qwen)
    for text in corpus()[:40] + TEXTS + fuzz(1000) + decomposed:
        ours, theirs = enc.encode(text, allowed_special='all'), hf.encode(text, add_special_tokens=False).ids
        assert ours == theirs, (kind, text)
        assert enc.decode(ours) == (unicodedata.normalize('NFC', text) if kind == 'qwen2' else text)
        assert np.array_equal(enc.encode_to_numpy(text, disallowed_special=()), enc.encode(text, disallowed_special=()))
        merged += sum(t > 300 for t in ours)
    assert merged > 1000  # the merges were exercised, not only single bytes
    assert enc.encode('<|im_end|><custom>', allowed_special='all') == [hf.token_to_id('<|im_end|>'), hf.token_to_id('<custom>')]
    assert tokenizer.eos_id(enc) == hf.token_to_id('<|endoftext|>')


def test_unsupported_tokenizers_fail_in_one_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    wordpiece = Tokenizer(models.WordPiece(unk_token='[UNK]'))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(corpus()[:5], trainers.WordPieceTrainer(vocab_size=300, special_tokens=['[UNK]']))
    wordpiece.save(str(tmp_path / 'wp.json'))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(corpus()[:5], trainers.BpeTrainer(vocab_size=300))
    bpe.save(str(tmp_path / 'ws.json'))
    for path, what in (('wp.json', 'WordPiece'), ('ws.json', 'pre-tokenizer is Whitespace')):
        with pytest.raises(ValueError) as e:
            tokenizer.get_tokenizer(str(tmp_path / path))
        assert 'byte-level BPE' in str(e.value) and what in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(ValueError, match="unknown tokenizer 'no such thing'"):
        tokenizer.get_tokenizer('no such thing')


def test_byte_encoding_eos_and_no_eos():
    enc = tokenizer.get_tokenizer('bytes')
    assert tokenizer.eos_id(enc) == 256 and enc.decode(enc.encode_ordinary('héllo')) == 'héllo'
    bare = tiktoken.Encoding('bare', pat_str=tokenizer.GPT2_PATTERN, mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={})
    with pytest.raises(ValueError, match='end-of-text'):
        tokenizer.eos_id(bare)


# -----------------------------------------------------------------------------
# shards

def llmc_shard(path, tokens):
    """A shard written the way llm.c / modded-nanogpt write them, independently of data.py."""
    header = np.zeros(256, np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, 'wb') as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, np.uint16).tobytes())


def test_llmc_shards_are_read_as_they_are(tmp_path):
    tokens = np.arange(5000) % 50257
    llmc_shard(str(tmp_path / 'fineweb_train_000001.bin'), tokens)
    llmc_shard(str(tmp_path / 'fineweb_val_000000.bin'), tokens[:999])
    assert np.array_equal(data.read_shard(str(tmp_path / 'fineweb_train_000001.bin')), tokens)
    assert data.shard_paths(str(tmp_path), 'val') == [str(tmp_path / 'fineweb_val_000000.bin')]
    x = data.Loader(str(tmp_path), 4, 64).next_batch()['x']
    assert all(np.array_equal(row.numpy(), np.arange(row[0], row[0] + 64)) for row in x)

    big = np.array([0, 65535, 65536, 200_000], np.uint32)  # version 2: tokens above 65535
    data.write_shard(str(tmp_path / 'big_train_000000.bin'), big, 2)
    assert np.array_equal(data.read_shard(str(tmp_path / 'big_train_000000.bin')), big)
    with open(tmp_path / 'bad.bin', 'wb') as f:
        f.write(np.zeros(300, np.int32).tobytes())
    with pytest.raises(ValueError, match='not a token shard'):
        data.read_shard(str(tmp_path / 'bad.bin'))
    with open(tmp_path / 'fineweb_train_000001.bin', 'r+b') as f:
        f.truncate(1024 + 2 * 4000)
    with pytest.raises(ValueError, match='does not hold the 5000 tokens'):
        data.read_shard(str(tmp_path / 'fineweb_train_000001.bin'))


def read_split(folder, split, ext='.bin'):
    paths = sorted(p for p in glob.glob(os.path.join(folder, f'{split}_*{ext}')))
    return np.concatenate([data.read_shard(p) for p in paths]) if paths else np.zeros(0), len(paths)


def test_prepare_text_equals_encoding_each_document(tmp_path, gpt2_tok):
    unit = 2000  # small work units, and a long text cut into pieces
    docs = corpus()[:30] + ['\n'.join(corpus()[30:36])]
    assert len(docs[-1]) > 3 * unit
    with open(tmp_path / 'in.txt', 'w') as f:
        f.write('\n<|endoftext|>\n'.join(docs))
    counts = data.prepare([str(tmp_path / 'in.txt')], str(tmp_path / 'out'), gpt2_tok, val_every=4,
                          shard_tokens=3000, workers=2, unit=unit)
    enc = tokenizer.get_tokenizer(gpt2_tok)
    expect = {'train': [], 'val': []}
    for i, doc in enumerate(docs, 1):
        expect['val' if i % 4 == 0 else 'train'] += [tokenizer.eos_id(enc)] + enc.encode_ordinary(doc.strip())
    for split in ('train', 'val'):
        tokens, shards = read_split(str(tmp_path / 'out'), split)
        assert tokens.tolist() == expect[split] and counts[split] == len(expect[split])
        assert shards == -(-len(expect[split]) // 3000)
    assert enc.decode(read_split(str(tmp_path / 'out'), 'val')[0].tolist()).count('<|endoftext|>') == len(docs) // 4


def test_prepare_jsonl_with_val_file_and_bad_field(tmp_path):
    for name, texts in (('a.jsonl', ['one', 'two', 'three']), ('b.jsonl', ['held out'])):
        with open(tmp_path / name, 'w') as f:
            f.writelines(json.dumps({'body': t, 'id': i}) + '\n' for i, t in enumerate(texts))
    folder = str(tmp_path / 'out')
    data.prepare([str(tmp_path / 'a.jsonl')], folder, 'bytes', 'jsonl', [str(tmp_path / 'b.jsonl')], text_field='body', workers=1)
    enc = tokenizer.byte_encoding()
    assert enc.decode(read_split(folder, 'train')[0].tolist()) == '<|endoftext|>one<|endoftext|>two<|endoftext|>three'
    assert enc.decode(read_split(folder, 'val')[0].tolist()) == '<|endoftext|>held out'
    with pytest.raises(FileExistsError, match='already holds token shards'):
        data.prepare([str(tmp_path / 'a.jsonl')], folder, 'bytes', 'jsonl', text_field='body', workers=1)
    with pytest.raises(ValueError, match="no field 'text' .*'body'.*set prepare.text_field"):
        data.prepare([str(tmp_path / 'a.jsonl')], str(tmp_path / 'o2'), 'bytes', 'jsonl', [str(tmp_path / 'b.jsonl')], workers=1)
    with pytest.raises(ValueError, match='no val documents'):
        data.prepare([str(tmp_path / 'a.jsonl')], str(tmp_path / 'o3'), 'bytes', 'jsonl', text_field='body', workers=1)


@pytest.mark.timeout(120)
def test_prepare_error_never_hangs_leaving_the_pool(tmp_path):
    # a worker's error used to leave the pool through terminate(), which hung in about
    # one call of 100 (CPython issue 96995): 300 calls hung 5 runs of 5 before the fix
    for name, texts in (('a.jsonl', ['one', 'two', 'three']), ('b.jsonl', ['held out'])):
        with open(tmp_path / name, 'w') as f:
            f.writelines(json.dumps({'body': t}) + '\n' for t in texts)
    for i in range(300):
        folder = tmp_path / f'out{i}'
        with pytest.raises(ValueError, match="no field 'text'"):
            data.prepare([str(tmp_path / 'a.jsonl')], str(folder), 'bytes', 'jsonl', [str(tmp_path / 'b.jsonl')], workers=2)
        assert not data.shard_paths(str(folder), 'train')


# -----------------------------------------------------------------------------
# SFT: chats and their loss masks

CHATS = {
    'messages': [{'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                               {'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': '2+2?'},
                               {'role': 'assistant', 'content': '4'}]},
                 {'messages': [{'role': 'user', 'content': 'Name a colour'}, {'role': 'assistant', 'content': 'Blue.'}]}],
    'conversations': [{'conversations': [{'from': 'human', 'value': 'Hi'}, {'from': 'gpt', 'value': 'Hello!'},
                                         {'from': 'human', 'value': '2+2?'}, {'from': 'gpt', 'value': '4'}]},
                      {'conversations': [{'from': 'system', 'value': 'x'}, {'from': 'human', 'value': 'Name a colour'},
                                         {'from': 'gpt', 'value': 'Blue.'}]}],
    'prompt_response': [{'prompt': 'Hi', 'response': 'Hello!'}, {'prompt': 'Name a colour', 'response': 'Blue.'}],
}


def show(enc, tokens, mask):
    """The conversation as text, with the tokens that count in brackets."""
    out, inside = '', False
    for t, m in zip(tokens, mask):
        if m != inside:
            out, inside = out + ('[' if m else ']'), bool(m)
        out += enc.decode([t])
    return out + (']' if inside else '')


@pytest.mark.parametrize('layout', list(CHATS))
def test_sft_masks_count_exactly_the_assistant_tokens(layout, tmp_path):
    with open(tmp_path / 'chat.jsonl', 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in CHATS[layout])
    folder = str(tmp_path / 'out')
    data.prepare([str(tmp_path / 'chat.jsonl')], folder, 'bytes', 'chat', [str(tmp_path / 'chat.jsonl')], workers=1)
    enc = tokenizer.byte_encoding()
    tokens, _ = read_split(folder, 'train')
    mask, _ = read_split(folder, 'train', '.mask')
    assert len(mask) == len(tokens) and set(np.unique(mask)) == {0, 1}
    answers = [t for row in CHATS[layout] for role, t in tokenizer.chat_turns(row) if role == 'assistant']
    assert enc.decode(tokens[mask == 1].tolist()) == ''.join(a + '<|im_end|>' for a in answers)
    assert mask.sum() == sum(len(enc.encode_ordinary(a)) + 1 for a in answers)
    first = show(enc, tokens.tolist(), mask.tolist()).split('<|endoftext|>')[1]
    print(first)
    if layout == 'prompt_response':
        assert first == '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[Hello!<|im_end|>]\n'


@pytest.mark.parametrize('kind', ['gpt2', 'smollm2'])
def test_chat_ids_equal_hf_tokenizing_the_rendered_template(kind, tmp_path):
    """HF renders a chat template to one string, then tokenizes it: an answer that starts with
    whitespace merges with the header's newline. Ours must give the same ids, and count every
    token that holds any of the answer."""
    hf = train_hf_tokenizer(kind, str(tmp_path))
    enc = tokenizer.get_tokenizer(str(tmp_path))
    for answer in ('Hello!', ' Hello!', '\n\nfirst paragraph', '    indented = True', '', '2024\n'):
        turns = [('user', 'Hi\n'), ('assistant', answer)]
        rendered = '<|endoftext|>' + ''.join(f'<|im_start|>{r}\n{t}<|im_end|>\n' for r, t in turns)
        tokens, mask = tokenizer.render_chat(enc, turns)
        assert tokens == hf.encode(rendered, add_special_tokens=False).ids, repr(answer)
        counted = enc.decode([t for t, m in zip(tokens, mask) if m])  # the answer, and at most the newline before
        assert counted.endswith(answer + '<|im_end|>') and ('\n' + answer + '<|im_end|>').endswith(counted)


def test_llama3_template_and_missing_chat_tokens():
    specials = ['<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
    enc = tiktoken.Encoding('llama-like', pat_str=tokenizer.GPT2_PATTERN, mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={t: 256 + i for i, t in enumerate(specials)})
    tokens, mask = tokenizer.render_chat(enc, [('user', 'Hi'), ('assistant', 'Yo')])
    assert show(enc, tokens, mask) == ('<|end_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>'
                                       '<|start_header_id|>assistant<|end_header_id|>\n\n[Yo<|eot_id|>]')
    plain = tiktoken.Encoding('plain', pat_str=tokenizer.GPT2_PATTERN, mergeable_ranks={bytes([i]): i for i in range(256)},
                              special_tokens={'<|endoftext|>': 256})
    with pytest.raises(ValueError, match='no chat tokens'):
        tokenizer.render_chat(plain, [('user', 'Hi')])
    with pytest.raises(ValueError, match="needs 'messages', 'conversations' or 'prompt' and 'response'"):
        tokenizer.chat_turns({'question': 'Hi'})


BAD_LINES = {  # a file's lines, the 1-based number of the bad one, and what its error must say
    'jsonl': ([{'text': 'fine'}, 'just a string', {'text': 'fine too'}], 2,
              ['is not a JSON object but "just a string"', 'write each line as {"text": "..."}']),
    'chat': ([CHATS['messages'][0], {'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'bot', 'content': 'Yo'}]}], 2,
             ["role 'bot' is not one of system, user, assistant", 'rename it']),
}


@pytest.mark.parametrize('fmt', list(BAD_LINES))
def test_a_bad_line_names_its_file_and_line(fmt, tmp_path):
    """A row that is not an object, or a chat role the templates do not know, ends in one line
    that names the file and the line; a 'bot' used to pass and leave no assistant token to learn."""
    rows, bad, says = BAD_LINES[fmt]
    path = tmp_path / 'in.jsonl'
    path.write_text('\n\n'.join(json.dumps(r) for r in rows))  # blank lines between: still the file's own numbers
    with pytest.raises(ValueError) as e:
        data.prepare([str(path)], str(tmp_path / 'out'), 'bytes', fmt, [str(path)], workers=1)
    msg = str(e.value)
    assert msg.startswith(f"{path} line {2 * bad - 1}") and all(s in msg for s in says) and '\n' not in msg, msg
    assert not data.shard_paths(str(tmp_path / 'out'), 'train')


def test_a_bad_chat_role_stops_train_py_in_one_line(tmp_path):
    path = tmp_path / 'chat.jsonl'
    path.write_text(json.dumps({'conversations': [{'from': 'human', 'value': 'Hi'}, {'from': 'bot', 'value': 'Yo'}]}) + '\n')
    r = subprocess.run([sys.executable, 'train.py', '--max_steps=1', f'--out_dir={tmp_path / "out"}', '--prepare.format=chat',
                        f'--dataset={tmp_path / "d"}', f"--prepare.files={{'train': '{path}'}}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().count('\n') == 0, r.stderr
    assert r.stderr.startswith(f"error: data: {path} line 1: role 'bot'") and 'eval_iters' not in r.stderr


def test_loader_turns_masks_into_ignored_targets(tmp_path):
    with open(tmp_path / 'chat.jsonl', 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in CHATS['messages'] * 20)
    folder = str(tmp_path / 'out')
    data.prepare([str(tmp_path / 'chat.jsonl')], folder, 'bytes', 'chat', val_every=10, workers=1)
    b = data.Loader(folder, 8, 32).next_batch()
    counted = b['y'] != data.IGNORE
    assert 0 < counted.sum() < counted.numel()
    text = tokenizer.byte_encoding().decode(b['y'][counted].tolist())
    assert set(text) <= set('Hello!4Blue.<|im_end|>')


# -----------------------------------------------------------------------------
# the loader

def unique_shards(folder, lengths, split='train'):
    """Shards whose tokens are all different, so a window's first token names it."""
    os.makedirs(folder, exist_ok=True)
    start = 0
    for i, n in enumerate(lengths):
        data.write_shard(os.path.join(folder, f'{split}_{i:06d}.bin'), np.arange(start, start + n), 1)
        start += n


def test_loader_ranks_see_disjoint_windows_covering_the_data(tmp_path):
    T, lengths = 16, [1000, 337, 2050]
    unique_shards(str(tmp_path), lengths)
    every = set()
    for s, n in enumerate(lengths):
        every |= {sum(lengths[:s]) + j * T for j in range((n - 1) // T)}
    seen = []
    for rank in range(2):
        per_epoch = sum(len(range(rank, (n - 1) // T, 2)) for n in lengths)
        loader = data.Loader(str(tmp_path), 1, T, rank=rank, world_size=2, seed=3)
        firsts = [loader.next_batch()['x'][0, 0].item() for _ in range(per_epoch)]
        assert len(set(firsts)) == per_epoch and loader.streams[0].pos[0] in (0, 1)
        seen.append(set(firsts))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == every


DDP_SCRIPT = """
import os, sys
import torch.distributed as dist
sys.path.insert(0, {root!r})
import data
dist.init_process_group('gloo')
rank, world = dist.get_rank(), dist.get_world_size()
loader = data.Loader({folder!r}, 4, 16, rank=rank, world_size=world, seed=1)
mine = [x for _ in range(20) for x in loader.next_batch()['x'][:, 0].tolist()]
every = [None] * world
dist.all_gather_object(every, mine)
if rank == 0:
    with open({out!r}, 'w') as f:
        f.write(repr(every))
dist.destroy_process_group()
"""


def test_loader_under_torchrun_two_ranks_disjoint(tmp_path):
    unique_shards(str(tmp_path / 'd'), [2000, 2000])
    script = tmp_path / 'ddp.py'
    script.write_text(DDP_SCRIPT.format(root=ROOT, folder=str(tmp_path / 'd'), out=str(tmp_path / 'out.txt')))
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = eval((tmp_path / 'out.txt').read_text())
    assert len(a) == len(b) == 80 and len(set(a)) == 80 and not set(a) & set(b)


def mixture(folder, **kw):
    return data.Loader({'uniq': (os.path.join(folder, 'u'), 1.0), 'chat': (os.path.join(folder, 'c'), 3.0)}, 4, 16, **kw)


def test_loader_resumes_exactly(tmp_path):
    unique_shards(str(tmp_path / 'u'), [300, 200])  # small: the run below crosses several epochs
    rows = [{'prompt': 'q' * i, 'response': 'a' * (i % 7 + 1)} for i in range(60)]
    with open(tmp_path / 'chat.jsonl', 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in rows)
    data.prepare([str(tmp_path / 'chat.jsonl')], str(tmp_path / 'c'), 'bytes', 'chat', val_every=10, shard_tokens=700, workers=1)
    a = mixture(str(tmp_path), seed=5)
    for _ in range(7):
        a.next_batch()
    a.reweight({'uniq': 0.5, 'chat': -0.5})
    torch.save(a.state_dict(), tmp_path / 'state.pt')  # as train.py would, in its checkpoint
    straight = [a.next_batch() for _ in range(40)]
    b = mixture(str(tmp_path), seed=5)
    b.load_state_dict(torch.load(tmp_path / 'state.pt', weights_only=True))
    resumed = [b.next_batch() for _ in range(40)]
    assert max(s.pos[0] for s in a.streams) >= 2  # epochs wrapped after the save
    for s, r in zip(straight, resumed):
        assert s.keys() == r.keys() and all(torch.equal(s[k], r[k]) for k in s)
    fresh = mixture(str(tmp_path), seed=5)
    assert not all(torch.equal(s['x'], f['x']) for s, f in zip(straight, (fresh.next_batch() for _ in range(40))))


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='no train shards'):
        data.Loader(str(tmp_path), 1, 16)
    unique_shards(str(tmp_path), [20])
    with pytest.raises(ValueError, match='too short for block_size=32'):
        data.Loader(str(tmp_path), 1, 32)


# -----------------------------------------------------------------------------
# mixtures: influence-based remixing

def test_remix_moves_weight_to_the_source_that_matches_val(tmp_path):
    from model import ModelConfig, Transformer
    enc, rng = tokenizer.byte_encoding(), np.random.default_rng(0)
    prose = np.array(data.offline_corpus(enc, val_fraction=0)[0])
    n = len(prose) // 2
    for name, split, tokens in (('prose', 'train', prose[:n]), ('noise', 'train', rng.integers(0, 256, n)),
                                ('target', 'val', prose[n:])):  # val: held-out prose
        os.makedirs(tmp_path / name)
        data.write_shard(str(tmp_path / name / f'{split}_000000.bin'), tokens, 1)

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                                    intermediate_size=64, max_seq_len=64, bitnet=True))
    logits = lambda out: out if torch.is_tensor(out) else getattr(out, 'logits', out[0])
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(logits(m(b['x'])).flatten(0, 1), b['y'].flatten())
    loader = data.Loader({'prose': (str(tmp_path / 'prose'), 1.0), 'noise': (str(tmp_path / 'noise'), 1.0)}, 8, 64, seed=1)
    val = data.Loader(str(tmp_path / 'target'), 8, 64, split='val')
    val_batches = [val.next_batch() for _ in range(2)]
    weights = [loader.weights[0]]
    for _ in range(3):
        scores = optim.source_scores(model, loss_fn, loader.source_batches(), val_batches)
        assert scores['prose'] > scores['noise'] + 0.1
        weights.append(loader.reweight(scores, eta=0.5, floor=0.05)['prose'])
    assert all(p.grad is None for p in model.parameters())
    assert weights[0] == 0.5 and weights[1] < weights[2] < weights[3] and weights[3] > 0.7
    drawn = torch.cat([loader.next_batch()['source'] for _ in range(300)])  # the sampler uses the new weights
    assert abs((drawn == 0).float().mean().item() - loader.weights[0]) < 0.03


def test_reweight_keeps_the_floor():
    loader = data.Loader.__new__(data.Loader)
    loader.names, loader.weights = ['a', 'b', 'c'], np.array([0.98, 0.01, 0.01])
    w = loader.reweight({'a': 5.0, 'b': -5.0, 'c': 0.0}, eta=1.0, floor=0.1)
    assert abs(sum(w.values()) - 1) < 1e-9 and min(w.values()) >= 0.1 - 1e-9 and w['a'] == max(w.values())
    with pytest.raises(ValueError, match='remix floor 0.4'):
        loader.reweight({'a': 0, 'b': 0, 'c': 0}, floor=0.4)


# -----------------------------------------------------------------------------
# setup and the offline corpus

def test_setup_data_prepares_once_and_guards_the_tokenizer(tmp_path):
    with open(tmp_path / 'in.txt', 'w') as f:
        f.write('<|endoftext|>'.join(corpus() * 2))  # enough documents for a val split of 1 in 100
    folder = str(tmp_path / 'd')
    files = {'train': str(tmp_path / 'in.txt')}
    data.setup_data(folder, files, 'bytes')
    made = os.path.getmtime(os.path.join(folder, 'train_000000.bin'))
    data.setup_data(folder, files, 'bytes')
    assert os.path.getmtime(os.path.join(folder, 'train_000000.bin')) == made and data.shard_paths(folder, 'val')
    with pytest.raises(ValueError, match="tokenizer 'bytes', not 'gpt2'; set tokenizer='bytes'"):
        data.setup_data(folder, files, 'gpt2')
    with pytest.raises(FileNotFoundError, match='set prepare.files'):
        data.setup_data(str(tmp_path / 'empty'))
    with pytest.raises(FileNotFoundError, match="data file .*nope.txt' not found"):
        data.setup_data(str(tmp_path / 'e2'), {'train': str(tmp_path / 'nope.txt')})


def test_a_copy_of_the_tokenizer_file_reads_the_shards_and_another_file_does_not(tmp_path, gpt2_tok):
    """A run's checkpoint carries a copy of its model's tokenizer.json: shards prepared with the
    model's are read with the copy's (the same bytes) under another name, and refused with a
    tokenizer file that differs in one merge, or without a file to compare."""
    import shutil
    with open(tmp_path / 'in.txt', 'w') as f:
        f.write('<|endoftext|>'.join(corpus() * 2))
    folder, files = str(tmp_path / 'd'), {'train': str(tmp_path / 'in.txt')}
    data.setup_data(folder, files, gpt2_tok, tokenizer_file=gpt2_tok)
    (tmp_path / 'ckpt').mkdir()
    copy = str(tmp_path / 'ckpt' / 'tokenizer.json')
    shutil.copy(gpt2_tok, copy)
    assert data.setup_data(folder, files, str(tmp_path / 'ckpt'), tokenizer_file=copy) == folder
    other = json.load(open(gpt2_tok))
    other['model']['merges'] = other['model']['merges'][:-1]
    (tmp_path / 'other').mkdir()
    json.dump(other, open(tmp_path / 'other' / 'tokenizer.json', 'w'))
    with pytest.raises(ValueError, match='holds tokens of tokenizer'):
        data.setup_data(folder, files, str(tmp_path / 'other'), tokenizer_file=str(tmp_path / 'other' / 'tokenizer.json'))
    with pytest.raises(ValueError, match='holds tokens of tokenizer'):
        data.setup_data(folder, files, str(tmp_path / 'ckpt'))


@pytest.mark.parametrize('name', ['tinystories', 'fineweb', 'sft'])
def test_data_configs_name_hub_files(name, monkeypatch):
    monkeypatch.delenv('HF_ENDPOINT', raising=False)
    scope = {}
    with open(os.path.join(ROOT, 'config', f'{name}.py')) as f:
        exec(f.read(), scope)
    prepare = scope['prepare']
    assert prepare['format'] in ('text', 'jsonl', 'chat', 'tokens') and set(prepare['files']) <= {'train', 'val'}
    files = [f for v in prepare['files'].values() for f in ([v] if isinstance(v, str) else v)]
    for src in files:
        repo, path = re.fullmatch(r'hf://datasets/([^/@]+/[^/@]+)/(.+)', src).groups()
        assert hub.hub_file(repo, path, 'dataset')[0] == f'https://huggingface.co/datasets/{repo}/resolve/main/{path}'
    assert len(files) == {'tinystories': 2, 'fineweb': 10, 'sft': 1}[name]


def test_offline_corpus_and_get_batch():
    enc = tokenizer.byte_encoding()
    train, val = data.offline_corpus(enc)
    from pydoc_data.topics import topics
    assert (train == 256).sum() + (val == 256).sum() == len(topics) and train.dtype == np.uint16
    x, y = data.get_batch(train, 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


# -----------------------------------------------------------------------------
# prepare throughput against tiktoken alone

def big_text(path, size=50_000_000):
    """About 50 MB of real text: the pydoc topics and the standard library's sources."""
    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()['stdlib'], '**', '*.py'), recursive=True)):
        with open(p, encoding='utf-8', errors='replace') as f:
            docs.append(f.read())
    out, total = [], 0
    while total < size:
        for d in docs:
            out.append(d)
            total += len(d.encode())
            if total >= size:
                break
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\n<|endoftext|>\n'.join(out))


@pytest.mark.slow
def test_prepare_throughput(tmp_path):
    """prepare on 2 processes vs tiktoken's encode_ordinary_batch on 2 threads, same BPE, same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = str(tmp_path / 'big.txt')
    big_text(path)
    with open(path, encoding='utf-8') as f:
        sample = f.read(8_000_000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([sample[i:i + 10_000] for i in range(0, len(sample), 10_000)], trainers.BpeTrainer(
        vocab_size=32000, special_tokens=['<|endoftext|>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / 'tokenizer.json'))
    enc = tokenizer.get_tokenizer(str(tmp_path / 'tokenizer.json'))
    docs = [doc for _, doc in data.documents(path, 'text')]
    mb = os.path.getsize(path) / 1e6
    alone, ours = [], []
    for run in range(3):  # a shared machine: alternate, and take the best of each
        t0 = time.time()
        enc.encode_ordinary_batch(docs, num_threads=2)
        alone.append(mb / (time.time() - t0))
        t0 = time.time()
        data.prepare([path], str(tmp_path / f'out{run}'), str(tmp_path / 'tokenizer.json'), workers=2)
        ours.append(mb / (time.time() - t0))
    print(f"\nprepare {mb:.1f} MB on 2 processes: best {max(ours):.2f} MB/s (runs {', '.join(f'{v:.2f}' for v in ours)}); "
          f"tiktoken encode_ordinary_batch, 2 threads: best {max(alone):.2f} MB/s; ratio {max(ours) / max(alone):.2f}")
    assert max(ours) >= 0.7 * max(alone)


def test_a_val_split_too_short_for_a_window_is_refused_before_training(tmp_path):
    """The val split is first read at the first evaluation; one too short for one window
    (block_size + 1 tokens) ends the run in one line before its first step, not in a
    traceback after it."""
    (tmp_path / 'docs.jsonl').write_text(''.join(json.dumps({'text': f'doc {i}'}) + '\n' for i in range(120)))
    cmd = [sys.executable, 'train.py', f'--dataset={tmp_path / "data"}', '--max_steps=2', '--batch_size=2',
           '--block_size=32', '--arch.n_layer=1', '--arch.n_embd=16', '--arch.n_head=2', '--arch.n_kv_head=2',
           f"--prepare={{'files': {{'train': '{tmp_path / 'docs.jsonl'}'}}, 'format': 'jsonl'}}",
           f'--out_dir={tmp_path / "out"}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith('error: data: ')
    assert 'the val shards are too short for block_size=32' in r.stderr and 'Traceback' not in r.stderr
    assert 'step 1' not in r.stdout and not (tmp_path / 'out' / 'log.jsonl').exists()
