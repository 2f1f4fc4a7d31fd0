# docs/conversion.md's best recipe (block-wise reconstruction for a third of the steps, then
# CE + KD at LR 1e-3) on three seeds (the data order), with AdamW's moments carried from the
# block phase into CE + KD (phase_reset=False, as before) and started afresh at the switch (the
# default), and with one weight scale per output row (the moments started afresh).
# `python sweep.py sweeps/phase_switch.py --workers=2`; the tables in docs/conversion.md read
# each arm's log.jsonl: val loss at steps 40 (the switch), 80 and 120, and the largest CE loss
# after the switch. 'scale per row, seed 1337' is sweeps/recipes.py's 'best, scale per row'.
import os
import runpy

convert = runpy.run_path(os.path.join(os.path.dirname(__file__), 'convert.py'))

out_dir = 'out-phase-switch'
max_steps = convert['max_steps']  # 120 steps of 2 x 256 tokens: 61,440
chunks = convert['chunks']
base = convert['base']
best = convert['arms']['block a third, then CE + KD, LR 1e-3']

arms = {}
for seed in (1337, 1, 2):
    arms[f'moments carried, seed {seed}'] = dict(best, seed=seed, phase_reset=False)
    arms[f'moments reset, seed {seed}'] = dict(best, seed=seed)
    arms[f'scale per row, seed {seed}'] = dict(best, seed=seed, weight_scale='row')
