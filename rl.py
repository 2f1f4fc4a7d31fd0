"""
Reinforcement learning with verifiable rewards: the batches GRPO trains on.

GRPO (Shao et al. 2024, DeepSeekMath §4) needs no value model: for each prompt it samples
a group of G completions from the current policy, scores each with reward functions, and
pushes up the completions that scored above their group's mean (objectives.GRPO). This
file makes those batches:

- prompts come from a jsonl file, one prompt per line under 'prompt' plus whatever
  columns the reward functions need (e.g. 'answer'); a chat model sees each prompt as a
  user turn followed by the assistant's header (tokenizer.chat_prompt);
- a reward function is a plain callable f(prompts, completions, **columns) -> [float],
  named in the config from `REWARDS` (a config file adds its own: `import rl;
  rl.REWARDS['name'] = f`); a completion's reward is the sum of its rewards;
- every optimizer step samples the step's prompts x G completions at once (engine.rollout,
  on the packed kernels when the base is frozen), then cuts them into micro-batches; with
  `iterations` > 1 a batch trains that many steps (TRL's num_iterations), so that the
  ratio to the sampling policy moves from 1 and the clip acts;
- row seeds come from (seed, step, row), so a resumed run and any number of DDP ranks
  sample what one uninterrupted process samples.

The offline task: one-step arithmetic problems, bare or told as a story, made from a seed,
answered as `#### 42` (the GSM8K convention, Cobbe et al. 2021). Its splits are held out by
value: no (operation, a, b) of val or test is asked in training under any wording, and
beyond's larger number lies past the training range, so that a score there measures what a
model computes, not what it was shown. (The first split, 'arithmetic' and
'arithmetic_heldout', held out by prompt text only, stays for the figures measured on it.)
`python rl.py` writes them and prints where.
"""
import inspect
import json
import os
import random
import re
import sys

import torch
import torch.distributed as dist

from checkpoint import load
from configurator import configure, words
from engine import llama_cpp_greedy, rollout
from hub import cache_dir
from objectives import group_advantages
from tokenizer import chat_prompt, chat_template, eos_id, get_tokenizer

# ------------------------------------------------------------------ the offline task

NAMES = ('Ann', 'Ben', 'Cara', 'Dev', 'Eli', 'Fay', 'Gus', 'Hana', 'Ivan', 'Jo')
THINGS = ('apples', 'books', 'coins', 'stamps', 'shells', 'pencils', 'cards', 'eggs')
OPERATIONS = {'add': lambda a, b: a + b, 'subtract': lambda a, b: a - b,
              'multiply': lambda a, b: a * b}
PROBLEMS = (  # (question, operation) from a name, a thing and two numbers a >= b
    ('What is {a} + {b}?', 'add'),
    ('What is {a} - {b}?', 'subtract'),
    ('What is {a} times {b}?', 'multiply'),
    ('{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?', 'add'),
    ('{n} has {a} {t} and gives {b} of them away. How many {t} does {n} have left?',
     'subtract'),
)
INSTRUCTION = 'Give the final answer as a number after ####, like this: #### <number>.'


def problem(rng, pairs):
    """One problem as {'prompt', 'answer'}: a template, then (a, b) from pairs[operation]
    (every operation's, when pairs is a function: pairs(rng) -> (a, b)), a name, a thing."""
    question, operation = rng.choice(PROBLEMS)
    a, b = pairs(rng) if callable(pairs) else rng.choice(pairs[operation])
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    prompt = question.format(n=name, t=thing, a=a, b=b) + '\n' + INSTRUCTION
    return {'prompt': prompt, 'answer': str(OPERATIONS[operation](a, b))}


def small_pair(rng):
    """Two numbers from 2 to 12, the larger first."""
    return tuple(sorted((rng.randint(2, 12), rng.randint(2, 12)), reverse=True))


def arithmetic_problems(n, seed, exclude=None):
    """n problems as {'prompt', 'answer'} rows: distinct ones, or, given `exclude`, any
    whose prompts are not in it (the training set repeats problems; the held-out one
    does not). One step on numbers from 2 to 12, so that a 135M model often computes
    the answer: what it lacks at first is the answer's format, and reinforcement
    needs some right answers to reinforce. These held-out prompts differ from the
    training ones in wording only: most of their (operation, a, b) are trained on
    (arithmetic_splits holds problems out by value)."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude or ())
    while len(rows) < n:
        row = problem(rng, small_pair)
        if row['prompt'] not in seen:
            if exclude is None:
                seen.add(row['prompt'])
            rows.append(row)
    return rows


def arithmetic_files(n_train=5000, n_heldout=200):
    """The first split's train.jsonl and heldout.jsonl, made once in the cache."""
    folder = os.path.join(cache_dir(), 'arithmetic')
    paths = [os.path.join(folder, f'{split}.jsonl') for split in ('train', 'heldout')]
    if all(os.path.exists(p) for p in paths):
        return paths
    heldout = arithmetic_problems(n_heldout, seed=1)
    train = arithmetic_problems(n_train, seed=0, exclude={r['prompt'] for r in heldout})
    for path, rows in zip(paths, (train, heldout)):
        write_rows(path, rows)
    return paths


def write_rows(path, rows):
    """A jsonl file, written whole or not at all."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in rows)
    os.replace(path + '.tmp', path)


def sft_rows(rows):
    """Problems as chat rows {prompt, response: '#### <answer>'}: the gold answers."""
    return [{'prompt': row['prompt'], 'response': '#### ' + row['answer']} for row in rows]


def arithmetic_sft_file():
    """The first split's training problems as chat rows (sft_rows), made once beside them."""
    train, _ = arithmetic_files()
    path = os.path.join(os.path.dirname(train), 'sft.jsonl')
    if not os.path.exists(path):
        with open(train) as f:
            write_rows(path, sft_rows([json.loads(line) for line in f]))
    return path


# the splits held out by value: every (operation, a, b) with 12 >= a >= b >= 2 belongs to
# one of train, val and test; beyond's larger number is past 12, so no training fact has it;
# wide's is past beyond's: prompts to distil on (the teacher's answers, not the gold ones)
# that hold no fact of val, test or beyond
SPLIT_FACTS = {'test': 0.25, 'val': 0.15}  # the share of each operation's 66 pairs
SPLIT_SIZES = {'train': 5000, 'val': 200, 'test': 200, 'beyond': 200, 'wide': 5000}
LARGER = {'beyond': (13, 20), 'wide': (21, 50)}  # the larger number; the smaller from 2 up
SPLIT_FILES = [*SPLIT_SIZES, 'sft_train', 'sft_val']  # arithmetic_splits' files


def arithmetic_facts(seed=0):
    """{split: {operation: [(a, b), ...]}}: each operation's pairs 12 >= a >= b >= 2,
    shuffled from `seed` and dealt to test, val and train by SPLIT_FACTS."""
    pairs = [(a, b) for a in range(2, 13) for b in range(2, a + 1)]
    rng = random.Random(seed)
    facts = {'train': {}, 'val': {}, 'test': {}}
    for operation in OPERATIONS:
        mine = rng.sample(pairs, len(pairs))
        n_test, n_val = (round(SPLIT_FACTS[s] * len(pairs)) for s in ('test', 'val'))
        facts['test'][operation] = mine[:n_test]
        facts['val'][operation] = mine[n_test:n_test + n_val]
        facts['train'][operation] = mine[n_test + n_val:]
    return facts


def larger_pair(low, high):
    """pairs(rng) -> (a, b): a from low to high, b from 2 up to a."""
    def pair(rng):
        a = rng.randint(low, high)
        return a, rng.randint(2, a)
    return pair


def arithmetic_splits():
    """{split: path} of the task held out by value, made once in the cache: train and
    wide (SPLIT_SIZES problems, repeats allowed), val, test and beyond (distinct prompts),
    on the facts of arithmetic_facts or past 12 (LARGER); and the chat rows sft_train and
    sft_val (sft_rows) that the teacher and the students train on."""
    folder = os.path.join(cache_dir(), 'arithmetic_splits')
    paths = {name: os.path.join(folder, f'{name}.jsonl') for name in SPLIT_FILES}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    facts = arithmetic_facts()
    for i, (split, n) in enumerate(SPLIT_SIZES.items()):
        rng = random.Random(100 + i)
        pairs = larger_pair(*LARGER[split]) if split in LARGER else facts[split]
        rows, seen = [], set()
        while len(rows) < n:
            row = problem(rng, pairs)
            if split in ('train', 'wide') or row['prompt'] not in seen:
                seen.add(row['prompt'])
                rows.append(row)
        write_rows(paths[split], rows)
        if split in ('train', 'val'):
            write_rows(paths[f'sft_{split}'], sft_rows(rows))
    return paths


def task_file(path):
    """A prompt file's path, the offline task's files by name: 'arithmetic' and
    'arithmetic_heldout' (the first split), 'arithmetic_<split>' and the chat rows
    'arithmetic_sft_train' and 'arithmetic_sft_val' (arithmetic_splits), made when first
    named; any other path is itself."""
    if path in ('arithmetic', 'arithmetic_heldout'):
        return arithmetic_files()[path == 'arithmetic_heldout']
    split = path.removeprefix('arithmetic_')
    if path != split and split in SPLIT_FILES:
        return arithmetic_splits()[split]
    return path


# ------------------------------------------------------------------ rewards

ANSWER = re.compile(r'####\s*(-?\d[\d,]*)')


def final_answer(completion):
    """The number after the last ####, commas dropped, or None."""
    found = ANSWER.findall(completion)
    return found[-1].replace(',', '') if found else None


def correct_answer(prompts, completions, answer, **columns):
    """1 when the final answer is the `answer` column's, else 0."""
    return [float(final_answer(c) == str(a)) for c, a in zip(completions, answer)]


def answer_format(prompts, completions, **columns):
    """1 when the completion ends with `#### <number>`, else 0."""
    return [float(re.search(r'####\s*-?\d[\d,]*\s*\.?\s*$', c) is not None)
            for c in completions]


REWARDS = {'correct_answer': correct_answer, 'format': answer_format}


def needed_columns(fn):
    """The columns a reward function names (its arguments without defaults)."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    return [p.name for p in params
            if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty]


# ------------------------------------------------------------------ prompts


def read_prompts(path, enc, rewards, room):
    """The rows of a prompt file, each with its prompt's tokens under 'tokens'. Raises
    ValueError naming what is missing: a reward's column, or room in the context
    (`room`: the model's context minus the completions' length)."""
    path = task_file(path)
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"prompt file {path} holds no rows")
    for name in rewards:
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r}; choose from {sorted(REWARDS)}")
        for column in ['prompt'] + needed_columns(REWARDS[name]):
            if any(column not in row for row in rows):
                raise ValueError(f"prompt file {path} lacks the column {column!r} that "
                                 f"reward {name!r} needs in every row")
    for i, row in enumerate(rows):
        row['tokens'] = chat_prompt(enc, row['prompt'])
        if len(row['tokens']) > room:
            raise ValueError(f"prompt {i} of {path} has {len(row['tokens'])} tokens; with "
                             f"max_new_tokens the context holds {room}: shorten it, or "
                             f"lower max_new_tokens")
    return rows


# ------------------------------------------------------------------ batches


def all_gather(x):
    """x of every rank, concatenated in rank order (x itself alone)."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def all_ranks_done(done):
    """Whether every rank's rows are done: under FSDP each forward gathers the weights
    from all ranks, so every rank samples until the last one is done."""
    left = (~done).sum().view(1)
    dist.all_reduce(left)
    return left.item() == 0


class Rollouts:
    """A step's GRPO batches from the prompt file `path`, each prompt sampled `group`
    times (once for on-policy distillation, objectives.OnPolicyKD); and the greedy
    scores of the prompts of `heldout` (a file, or '' for none).
    Prompts and completions must fit the model's `context`. How many prompts a
    micro-batch holds and how many micro-batches a step has are the trainer's, given
    at every step."""

    def __init__(self, path, heldout, enc, context, seed=0, rank=0, world_size=1,
                 sync=False, group=8, max_new_tokens=128, temperature=1.0, top_p=1.0,
                 rewards=('correct_answer',), scale_rewards='group', iterations=1):
        if group < 1:
            raise ValueError(f"grpo.group={group}; set it to 1 or more completions a prompt")
        room = context - max_new_tokens
        self.rows = read_prompts(path, enc, rewards, room)
        self.heldout = read_prompts(heldout, enc, rewards, room) if heldout else []
        self.enc = enc
        self.group, self.max_new_tokens = group, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.rewards, self.scale_rewards = list(rewards), scale_rewards
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.iterations = iterations
        self.cached = {'start': None}  # the batches in use, and the step that sampled them
        self.all_done = all_ranks_done if sync else None
        self.stop_ids = [eos_id(enc), enc.encode_single_token(chat_template(enc)[2])]
        shuffle = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(self.rows), generator=shuffle)

    @classmethod
    def from_settings(cls, grpo, readers, enc, context, seed=0, rank=0, world_size=1,
                      sync=False):
        """A run's rollouts from train.py's `grpo` settings (data, heldout and the
        sampling's keywords), or None when they name no data; `readers`, the names of
        the objectives that will read them, each checked against the settings."""
        if readers and not grpo['data']:
            raise ValueError(f"objective {readers[0]!r} trains on the model's completions "
                             f"of prompts; set --grpo.data to a prompt file")
        if 'grpo' in readers and grpo['group'] < 2:
            raise ValueError(f"grpo.group={grpo['group']}: GRPO compares at least 2 "
                             f"completions of a prompt; set --grpo.group=2 or more")
        if not grpo['data']:
            return None
        kwargs = {k: v for k, v in grpo.items() if k not in ('data', 'heldout')}
        return cls(grpo['data'], grpo['heldout'], enc, context, seed, rank, world_size,
                   sync, **kwargs)

    def texts(self, x, mask):
        """The completions as text, their stop tokens left out."""
        P = x.size(1) - mask.size(1)
        texts = []
        for tokens, keep in zip(x[:, P:].tolist(), mask.tolist()):
            ids = [t for t, k in zip(tokens, keep) if k and t not in self.stop_ids]
            texts.append(self.enc.decode(ids))
        return texts

    def score(self, rows, completions):
        """(B, rewards) tensor of every reward function's scores."""
        prompts = [row['prompt'] for row in rows]
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != 'tokens'}
        columns.pop('prompt')
        scores = [REWARDS[name](prompts, completions, **columns) for name in self.rewards]
        return torch.tensor(scores, dtype=torch.float32).T

    def state_dict(self):
        """The batches in use (a resumed run needs them until `iterations` steps used them)."""
        return self.cached

    def load_state_dict(self, state):
        self.cached = state

    def probe(self, prompts, device):
        """A micro-batch of `prompts` prompts in the largest shape sampling can give (the
        longest prompt, every completion max_new_tokens long), its tokens arbitrary: what
        auto batch tries a micro-batch size with."""
        n, L = prompts * self.group, self.max_new_tokens
        P = max(len(row['tokens']) for row in self.rows)
        x = torch.randint(self.enc.n_vocab, (n, P + L), device=device)
        valid = torch.ones_like(x, dtype=torch.bool)
        return {'rollouts': {
            'x': x, 'valid': valid, 'mask': valid[:, P:],
            'advantages': torch.ones(n, device=device), 'max_len': L,
            'active_tokens': torch.tensor(float(n * L), device=device),
            'temperature': self.temperature}}

    def step(self, model, step, prompts, micro_steps):
        """(micro-batches, metrics) for optimizer step `step`, `micro_steps` micro-batches
        of `prompts` prompts each: sampled at every `iterations`-th step, and used until
        the next."""
        start = step - step % self.iterations
        if self.cached['start'] != start:
            batches, metrics = self.sample(model, start, prompts, micro_steps)
            self.cached = {'start': start, 'batches': batches, 'metrics': metrics}
        return self.cached['batches'], self.cached['metrics']

    @torch.no_grad()
    def sample(self, model, step, prompts, micro_steps):
        """(micro-batches, metrics) sampled at optimizer step `step`: rank r takes the r-th
        run of the step's prompts; rewards are gathered from every rank so that advantages
        and the token count of the 'dapo' loss are the whole batch's."""
        per_rank = prompts * micro_steps
        first = (step * self.world_size + self.rank) * per_rank
        picks = [int(self.order[(first + i) % len(self.rows)]) for i in range(per_rank)]
        rows = [self.rows[i] for i in picks for _ in range(self.group)]
        first_row = first * self.group
        seeds = [(self.seed * 1_000_003 + step) * 1_000_003 + first_row + i
                 for i in range(len(rows))]
        x, valid, mask, _ = rollout(model, [row['tokens'] for row in rows],
                                    self.max_new_tokens, self.temperature, self.top_p,
                                    self.stop_ids, seeds, self.enc.n_vocab,
                                    all_done=self.all_done)
        scores = self.score(rows, self.texts(x, mask))  # (B, rewards)
        every = all_gather(scores.to(x.device))
        total = every.sum(1)
        advantages = group_advantages(total, self.group, self.scale_rewards)
        B = len(rows)
        mine = advantages[self.rank * B:(self.rank + 1) * B]
        tokens = all_gather(mask.sum().view(1)).sum()
        micro_batches = self.world_size * micro_steps
        active = tokens.float() / micro_batches
        n = prompts * self.group
        batches = []
        for m in range(micro_steps):
            part = slice(m * n, (m + 1) * n)
            batches.append({'rollouts': {
                'x': x[part], 'valid': valid[part], 'mask': mask[part],
                'advantages': mine[part], 'max_len': self.max_new_tokens,
                'active_tokens': active, 'temperature': self.temperature}})
        metrics = {f'reward_{name}': every[:, i].mean().item()
                   for i, name in enumerate(self.rewards)}
        if self.group > 1:
            metrics['reward_std'] = total.view(-1, self.group).std(1).mean().item()
        metrics['completion_len'] = tokens.item() / len(total)
        return batches, metrics

    @torch.no_grad()
    def heldout_texts(self, model, temperature=0.0, seed=0, batch=50):
        """The held-out prompts' completions: greedy, or sampled at `temperature` with
        row seeds from `seed`."""
        rows, texts = self.heldout, []
        for i in range(0, len(rows), batch):
            part = rows[i:i + batch]
            seeds = [seed * 1_000_003 + i + j for j in range(len(part))]
            x, _, mask, _ = rollout(model, [row['tokens'] for row in part],
                                    self.max_new_tokens, temperature, self.top_p,
                                    self.stop_ids, seeds, self.enc.n_vocab,
                                    all_done=self.all_done)
            texts += self.texts(x, mask)
        return texts

    def gguf_texts(self, path):
        """The held-out prompts' greedy completions through llama.cpp, from a GGUF file."""
        answer = llama_cpp_greedy(path)
        texts = []
        for row in self.heldout:
            new = answer(row['tokens'], self.max_new_tokens, self.stop_ids, self.enc.n_vocab)
            texts.append(self.enc.decode([t for t in new if t not in self.stop_ids]))
        return texts

    def heldout_scores(self, model, temperature=0.0, seed=0, batch=50):
        """Each reward's mean over the held-out prompts' completions (heldout_texts)."""
        texts = self.heldout_texts(model, temperature, seed, batch)
        return self.mean_scores(texts)

    def mean_scores(self, texts):
        """Each reward's mean over the held-out prompts, given their completions."""
        means = self.score(self.heldout, texts).mean(0)
        return {f'heldout_{name}': means[i].item() for i, name in enumerate(self.rewards)}


@torch.no_grad()
def logit_gap(model, enc, prompt, ours, theirs):
    """How near a tie the greedy pick was where two completions of `prompt` (token
    ids) part: at their first differing token, our model's logit of `ours`'s token
    minus `theirs`'s, in one forward pass over the prompt and the shared start. None
    where one text is the start of the other (they part at a stop token)."""
    a, b = enc.encode(ours), enc.encode(theirs)
    parted = [j for j, (u, v) in enumerate(zip(a, b)) if u != v]
    if not parted:
        return None
    k = parted[0]
    logits = model(torch.tensor([prompt + a[:k]]))[0, -1].float()
    return round((logits[a[k]] - logits[b[k]]).item(), 3)


def main(argv):
    """python rl.py: write the offline task and print where. With --ckpt=DIR (what sample.py
    takes): that model's scores on --split (val, test, beyond: arithmetic_splits; heldout:
    the first split's), greedy, or sampled at --temperature once per --seeds=0,1,2 (the
    spread an untrained model shows by chance). With --gguf=FILE, its
    export beside it: both answer greedily, the GGUF through llama.cpp; their scores, how
    many completions are the same, and each pair that is not, with our logit_gap where
    they part. Ours decodes --batch prompts at a time."""
    settings = dict(ckpt='', split='val', max_new_tokens=48, rewards='correct_answer,format',
                    temperature=0.0, seeds='0', gguf='', batch=50)
    ranges = {'max_new_tokens': 'positive', 'temperature': 'non-negative',
              'batch': 'positive',
              'rewards': 'non-empty', 'seeds': 'non-empty',
              'split': ('val', 'test', 'beyond', 'wide', 'heldout')}
    c = configure(settings, words(argv, most=0)[1], ranges)
    if not c['ckpt']:
        print('\n'.join([*arithmetic_splits().values(), *arithmetic_files(),
                         arithmetic_sft_file()]))
        return
    seeds = c['seeds'].split(',')
    if not all(s.isdigit() for s in seeds):
        raise SystemExit(f"error: seeds={c['seeds']!r}; set --seeds to integers, e.g. 0,1,2")
    if c['gguf'] and not os.path.isfile(c['gguf']):
        raise SystemExit(f"error: gguf={c['gguf']!r} is no file; write one with "
                         f"python export.py --ckpt={c['ckpt']} --gguf=FILE")
    try:
        _, model, tokenizer = load(c['ckpt'])
        enc = get_tokenizer(tokenizer)
        scorer = Rollouts('arithmetic', f"arithmetic_{c['split']}", enc, model.config.max_seq_len,
                          max_new_tokens=c['max_new_tokens'],
                          rewards=c['rewards'].split(','))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise SystemExit(f"error: {e}") from None
    if c['gguf']:
        try:  # first: a file llama.cpp cannot load fails before any of our work
            theirs = scorer.gguf_texts(c['gguf'])
        except (ImportError, ValueError) as e:
            raise SystemExit(f"error: {c['gguf']}: {e}") from None
        ours = scorer.heldout_texts(model, batch=c['batch'])
        same = sum(a == b for a, b in zip(ours, theirs))
        print(json.dumps(dict(ours=scorer.mean_scores(ours), llama_cpp=scorer.mean_scores(theirs),
                              same_completions=same, of=len(ours))), flush=True)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                gap = logit_gap(model, enc, scorer.heldout[i]['tokens'], a, b)
                pair = dict(problem=i, ours=a, llama_cpp=b, logit_gap=gap)
                print(json.dumps(pair), flush=True)
        return
    for seed in seeds:
        scores = scorer.heldout_scores(model, c['temperature'], int(seed), c['batch'])
        print(json.dumps(dict(temperature=c['temperature'], seed=int(seed), **scores)),
              flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
