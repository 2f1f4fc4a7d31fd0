# docs/conversion.md's best recipe against the levers not yet measured there, SmolLM2-135M-Instruct
# made ternary with 61,440 tokens per arm, as sweeps/convert.py trains it. The teacher's own text
# must be written first (data/smollm2-teacher: 61,440 train tokens of LLM-QAT style text, held-out
# documents from other seeds):
#   python teach.py --ckpt=$HOME/.cache/nanobitnet/SmolLM2-135M-Instruct --out=data/smollm2-teacher
#   python sweep.py sweeps/recipes.py --workers=2
# The arms on the offline corpus see the same batches; so do the two on teacher text.
import os
import runpy

convert = runpy.run_path(os.path.join(os.path.dirname(__file__), 'convert.py'))
SMOLLM2 = convert['SMOLLM2']

out_dir = 'out-recipes'
max_steps = convert['max_steps']  # 120 steps of 2 x 256 tokens
chunks = convert['chunks']
base = convert['base']
best = convert['arms']['block a third, then CE + KD, LR 1e-3']
teacher_text = dict(dataset='data/smollm2-teacher')

arms = {
    'CE only': {},
    'best': best,
    'best, scale per row': dict(best, weight_scale='row'),
    'best, a norm before every linear': dict(best, linear_norm=True),
    'CE + KD, LR 1e-3': dict(convert['arms']['CE + KD'], learning_rate=1e-3, min_lr=1e-4),
    'CE only, teacher text': teacher_text,
    'best, teacher text': dict(best, **teacher_text),
}
