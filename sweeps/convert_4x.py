# sweeps/convert.py's arms at four times the tokens: 480 steps of 2 x 256 tokens (245,760 tokens,
# 2.4 passes over the offline corpus's training split), every phase and ramp at the same fraction.
import os
import runpy

globals().update(runpy.run_path(os.path.join(os.path.dirname(__file__), 'convert.py')))
out_dir = 'out-convert-4x'
max_steps = 480
base = dict(base, eval_interval=160)  # a chunk ends at steps 160, 320, 480
