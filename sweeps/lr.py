# A learning-rate sweep of the default model (`python train.py` with no arguments): four arms
# trained side by side in three chunks, two at a time, the worse half stopped after the first
# chunk (successive halving), on the CPU (docs/sweeps.md).
#   python sweep.py sweeps/lr.py --workers=2
out_dir = 'out-sweep-lr'
base = {}
max_steps = 750
chunks = 3  # a chunk ends at an evaluation: steps 250, 500, 750
grid = {'learning_rate': [1e-3, 2e-3, 3e-3, 6e-3]}
halving = True
