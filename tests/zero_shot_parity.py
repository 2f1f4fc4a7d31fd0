"""SmolLM2-135M-Instruct on the five zero-shot tasks, scored by eval.py through our forward and
through transformers' (the forward the only difference): per task the accuracies of both, the
largest difference of a summed log-probability and our time. docs/evaluation.md quotes it.

    python tests/zero_shot_parity.py [--hellaswag_limit=N] [--theirs_limit=N] [--out=FILE]

Every question through ours, but HellaSwag's first N (0: all, about 90 minutes on 2 cores);
each task's first N through transformers (0: all). Done tasks are kept in FILE."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eval  # noqa: E402
from model import Transformer  # noqa: E402
from smollm2 import smollm2  # noqa: E402
from tokenizer import eos_id, get_tokenizer  # noqa: E402

TASKS = ['arc_easy', 'arc_challenge', 'piqa', 'winogrande', 'hellaswag']


def main(hellaswag_limit=0, theirs_limit=0, out='zero_shot_parity.json'):
    import transformers
    torch.set_grad_enabled(False)
    src = smollm2()
    enc = get_tokenizer(src)
    ours = Transformer.from_pretrained(src).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    results = json.load(open(out)) if os.path.exists(out) else {}
    for task in [t for t in TASKS if t not in results]:
        qs = eval.load_task(task, (hellaswag_limit if task == 'hellaswag' else 0) or None)
        t0 = time.time()
        a, _ = eval.choice_logprobs(ours, enc, qs, eos_id(enc), 2048, what=f'{task} (ours)')
        seconds = time.time() - t0
        some = qs[:theirs_limit or None]
        b, _ = eval.choice_logprobs(lambda x: theirs(x).logits, enc, some, eos_id(enc), 2048,
                                    what=f'{task} (transformers)')
        diff = max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t))
        results[task] = dict(ours=eval.accuracy(qs, a), ours_seconds=round(seconds, 1),
                             ours_on_theirs=eval.accuracy(some, a[:len(some)]),
                             theirs=eval.accuracy(some, b), max_sum_diff=diff, sums=a)
        with open(out, 'w') as f:
            json.dump(results, f)
        r = results[task]
        print(f"{task}: {len(qs)} questions in {seconds:.0f} s, acc {r['ours']['acc']:.4f} "
              f"acc_norm {r['ours']['acc_norm']:.4f}; on {len(some)} questions ours "
              f"{r['ours_on_theirs']['acc']:.4f}/{r['ours_on_theirs']['acc_norm']:.4f}, "
              f"transformers {r['theirs']['acc']:.4f}/{r['theirs']['acc_norm']:.4f}, "
              f"max |sum difference| {diff:.2e}", flush=True)


if __name__ == '__main__':
    args = dict(a.removeprefix('--').split('=', 1) for a in sys.argv[1:])
    main(int(args.get('hellaswag_limit', 0)), int(args.get('theirs_limit', 0)),
         args.get('out', 'zero_shot_parity.json'))
