"""
Token shards a teacher writes, for a student to learn from:

    python teach.py --ckpt=DIR --out=data/teacher         # its own text
    python teach.py --ckpt=DIR --out=data/answers --prompts=config/chat.jsonl
    python teach.py --ckpt=DIR --out=data/wide --prompts=arithmetic_wide   # a task's prompts

Its own text is made as LLM-QAT (Liu et al. 2023) makes it, which distils a quantized
model on what the fp model writes rather than on real text: each document is
<|endoftext|> and a random ordinary token, continued greedily for `greedy` tokens, then
sampled at temperature 1 up to `length` tokens. With --prompts, each line of the file (a
chat jsonl line as data.py reads them, up to its first answer; a task's problem, its
prompt; or a line of plain text, a user's message) is put in the model's chat template
and answered by sampling until the turn ends: the text a chat student must learn, its
loss on the answers alone (--prompt_loss=True: on every token). Both are batched with the
KV cache (engine.teacher_text); every document comes from its own seed, so the shards
depend on `seed` alone. The val split is held out: documents from seeds the train split
does not use, and every tenth prompt. The shards are prepare's (data.write_documents):
train.py reads them with --dataset=OUT and the teacher's tokenizer, in any objective,
mixture or sweep.
"""
import itertools
import json
import math
import sys
import time

import torch

from checkpoint import check_output, load
from configurator import configure
from data import shard_paths, write_documents
from engine import teacher_text
from rl import task_file
from tokenizer import chat_prompt, chat_template, chat_turns, eos_id, get_tokenizer

ckpt = 'out'           # the teacher: a run's folder, a checkpoint, an HF directory
out = ''               # the folder the shards go to
tokens = 61440         # its own text: this many train tokens at least (val: a tenth)
length = 256           # ... tokens per document
greedy = 4             # ... tokens after the random one chosen greedily
prompts = ''           # a prompt file (or rl.py's task by name): its answers, not its own text
answers = 1            # ... answers per prompt, each from its own seed
max_answer = 256       # ... tokens per answer at most
prompt_loss = False    # ... the loss on the prompts' tokens too (else on the answers' alone)
seed = 1337
batch_size = 16
device = 'cuda' if torch.cuda.is_available() else 'cpu'
settings = {k: v for k, v in globals().items() if isinstance(v, (int, float, str))}
settings = {k: v for k, v in settings.items() if not k.startswith('_')}
ranges = {'out': 'non-empty', 'tokens': 'positive', 'length': 'positive',
          'greedy': 'non-negative', 'answers': 'positive', 'max_answer': 'positive',
          'batch_size': 'positive'}
config = configure(settings, sys.argv[1:], ranges)
globals().update(config)
if device.startswith('cuda') and not torch.cuda.is_available():
    sys.exit(f"error: device={device!r}, but this torch sees no CUDA GPU; set --device=cpu")
if shard_paths(out, 'train') or shard_paths(out, 'val'):
    sys.exit(f"error: {out} already holds token shards; delete them or use another --out")
try:
    check_output(out, 'out', made=True)
except ValueError as e:
    sys.exit(f"error: {e}")
if greedy + 2 > length:
    sys.exit(f"error: greedy={greedy} leaves nothing to sample in length={length}; "
             "lower greedy or raise length")
try:
    ckpt, model, tokenizer = load(ckpt, device)
    enc = get_tokenizer(tokenizer)
    eos = eos_id(enc)
except (OSError, ValueError, RuntimeError, KeyError) as e:
    sys.exit(f"error: cannot load {ckpt!r}: {e}")
vocab = min(enc.n_vocab, model.config.vocab_size)  # never an embedding's padding rows


def own_text(n, first_seed):
    """n documents of the model's own text, from seeds first_seed, first_seed + 1, ..."""
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    ordinary = [i for i in range(vocab) if i not in special]
    seeds = list(range(first_seed, first_seed + n))
    starts = []
    for s in seeds:  # the random first token, from the document's own seed
        generator = torch.Generator().manual_seed(s)
        pick = torch.randint(len(ordinary), (1,), generator=generator).item()
        starts.append([eos, ordinary[pick]])
    return teacher_text(model, starts, length - 2, seeds, greedy, vocab=vocab,
                        batch=batch_size)


def asked(line):
    """A prompt file's line as the conversation up to its first answer: a chat jsonl
    line, a task's problem ({"prompt": ..., "answer": ...}, as rl.py's files hold them:
    its prompt) or a line of plain text."""
    if not line.startswith('{'):
        return [('user', line)]
    row = json.loads(line)
    if isinstance(row, dict) and isinstance(row.get('prompt'), str) and 'response' not in row:
        return [('user', row['prompt'])]
    return list(itertools.takewhile(lambda turn: turn[0] != 'assistant', chat_turns(row)))


def answered(conversations, first_seed):
    """Each conversation and `answers` answers to it, each from its own seed, and each
    answer's loss mask: 1 on the answer's tokens, 0 on its prompt's, as prepare's chat
    rows count the assistant's text alone."""
    starts = [chat_prompt(enc, turns) for turns in conversations for _ in range(answers)]
    seeds = list(range(first_seed, first_seed + len(starts)))
    end = enc.encode_single_token(chat_template(enc)[2])  # the token that ends a turn
    texts = teacher_text(model, starts, max_answer, seeds, stop_ids=(end, eos),
                         vocab=vocab, batch=batch_size)
    masks = [[0] * len(start) + [1] * (len(text) - len(start))
             for start, text in zip(starts, texts)]
    return texts, masks


t0 = time.time()
if prompts:
    try:  # every line read and checked before any answer is sampled
        with open(task_file(prompts), encoding='utf-8') as f:
            conversations = [asked(line.strip()) for line in f if line.strip()]
        chat_template(enc)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: prompts {prompts!r}: {e}")
    if len(conversations) < 10:
        sys.exit(f"error: {prompts} has {len(conversations)} prompts; every tenth is held "
                 "out, so give at least 10")
    held_out = conversations[9::10]  # none of them trained on
    trained = [c for i, c in enumerate(conversations) if i % 10 != 9]
    documents, masks = {}, {}
    documents['train'], masks['train'] = answered(trained, seed)
    documents['val'], masks['val'] = answered(held_out, seed + 10 ** 6)
    masks = None if prompt_loss else masks
else:
    n = math.ceil(tokens / length)
    documents = {'train': own_text(n, seed),
                 'val': own_text(max(1, n // 10), seed + 10 ** 6)}
    masks = None  # its own text counts everywhere
try:
    counts = write_documents(out, documents, tokenizer, masks)
except (OSError, ValueError) as e:
    sys.exit(f"error: cannot write {out!r}: {e}")
print(f"wrote {out}: {counts['train']:,} train and {counts['val']:,} val tokens, "
      f"{sum(map(len, documents.values()))} documents, in {time.time() - t0:.0f}s")
