# SmolLM2-135M-Instruct made ternary by train.py, one arm per recipe, trained side by side in
# three chunks (docs/distillation.md). `python bench.py distill` runs this sweep, then scores every
# arm on held-out text and asks the best one the chat prompts; `python sweep.py sweeps/distill.py`
# trains the arms alone. Every arm runs `base` with its own settings on top: the same data order,
# steps and schedules. The teacher is the frozen fp model (made once by `python tests/smollm2.py`).
import os

from hub import cache_dir

SMOLLM2 = os.path.join(cache_dir(), 'SmolLM2-135M-Instruct')

out_dir = 'out-distill'
max_steps = 120
chunks = 3  # a chunk ends at each evaluation: steps 40, 80, 120
base = dict(init_from=SMOLLM2, tokenizer=SMOLLM2, bitnet=True, batch_size=2, block_size=256,
            learning_rate=5e-4, min_lr=5e-5, warmup_steps=10, weight_decay=0.0,
            lambda_warmup=0.5, eval_interval=40, eval_iters=4, log_interval=5,
            ckpt={'keep_last': 1}, sample={'prompts': ['The try statement', 'def fibonacci(n):']})

ce_kd = dict(teacher=SMOLLM2, objectives={'ce': {}, 'kd': {'temperature': 5.0}},
             curriculum=[(1.0, {'ce': 1.0, 'kd': 1.0})])


def bitdistill(attn):
    """CE for half the steps, then CE + KD (T 5) + attention-relation KD of weight attn."""
    return dict(
        teacher=SMOLLM2,
        objectives={'ce': {}, 'kd': {'temperature': 5.0}, 'attn': {'layer': -1, 'heads': 4}},
        curriculum=[(0.5, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'attn': attn})])


arms = {
    'CE only': {},
    'CE + KD (T 5)': ce_kd,
    'BitDistill': bitdistill(10.0),
    'KD only (T 5)': dict(teacher=SMOLLM2, objectives={'kd': {'temperature': 5.0}},
                          curriculum=[(1.0, {'kd': 1.0})]),
    'CE + KD, SubLN gain 1': dict(ce_kd, subln_calib=0),
    'CE + KD, no lambda warmup': dict(ce_kd, lambda_warmup=0.0),
    'BitDistill, attention KD weight 1': bitdistill(1.0),
    'CE + KD (T 1)': dict(ce_kd, objectives={'ce': {}, 'kd': {'temperature': 1.0}}),
}

# asked of the teacher, the CE-only student and the best arm, greedily, in the chat template
chat = ['What is the capital of France?', 'Write a Python function that reverses a string.',
        'Give me three tips for staying focused.']
