# docs/conversion.md's best recipe with one weight scale per output row, on the three seeds (the
# data order) on which sweeps/phase_switch.py runs it with one scale per matrix ('moments reset'
# arms): whether the per-row lead of sweeps/recipes.py holds beyond one seed.
# `python sweep.py sweeps/row_scales.py --workers=2`; seed 1337 (the default) is
# sweeps/recipes.py's 'best, scale per row'.
import os
import runpy

convert = runpy.run_path(os.path.join(os.path.dirname(__file__), 'convert.py'))

out_dir = 'out-row-scales'
max_steps = convert['max_steps']  # 120 steps of 2 x 256 tokens: 61,440
chunks = convert['chunks']
base = convert['base']
best = convert['arms']['block a third, then CE + KD, LR 1e-3']

arms = {f'scale per row, seed {seed}': dict(best, seed=seed, weight_scale='row')
        for seed in (1, 2)}
