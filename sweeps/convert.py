# SmolLM2-135M-Instruct made ternary with as few tokens as possible: end-to-end CE + KD against
# a block-wise reconstruction phase first (docs/conversion.md). Every arm trains on the same
# 120 steps of 2 x 256 tokens (61,440 tokens), block-wise phase included, in the same data order;
# `python sweep.py sweeps/convert.py --workers=2` trains them, eval.py scores them.
import os
import runpy

# distillation.md's model, data, steps and schedules (sweeps/distill.py), one sample prompt
distill = runpy.run_path(os.path.join(os.path.dirname(__file__), 'distill.py'))
SMOLLM2 = distill['SMOLLM2']

out_dir = 'out-convert'
max_steps = distill['max_steps']  # 120
chunks = distill['chunks']  # a chunk ends at each evaluation: steps 40, 80, 120
base = dict(distill['base'], sample={'prompts': ['The try statement']})

KD = {'temperature': 5.0}


def block_then(end, **settings):
    """Block-wise reconstruction for the first `end` of the steps, ternary from the first step
    (lambda 1), then CE + KD (T 5) on the blocks it made."""
    return dict(teacher=SMOLLM2, lambda_warmup=0.0,
                objectives={'block': {}, 'ce': {}, 'kd': KD},
                curriculum=[(end, {'block': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0})], **settings)


arms = {
    'CE only': {},
    'CE + KD': dict(teacher=SMOLLM2, objectives={'ce': {}, 'kd': KD},
                    curriculum=[(1.0, {'ce': 1.0, 'kd': 1.0})]),
    'block a third, then CE + KD': block_then(1 / 3),
    'block a third, then CE + KD, LR 1e-3': block_then(1 / 3, learning_rate=1e-3, min_lr=1e-4),
    'block + CE + KD throughout': dict(teacher=SMOLLM2, lambda_warmup=0.0,
                                       objectives={'block': {}, 'ce': {}, 'kd': KD},
                                       curriculum=[(1.0, {'block': 1.0, 'ce': 1.0, 'kd': 1.0})]),
}
