# A learning-rate sweep of the default model (`python train.py` with no arguments): four arms
# trained side by side in four chunks, on the CPU (docs/sweeps.md).
#   python sweep.py sweeps/lr.py
out_dir = 'out-sweep-lr'
base = {}
max_steps = 750
chunks = 4
grid = {'learning_rate': [1e-3, 2e-3, 3e-3, 6e-3]}
