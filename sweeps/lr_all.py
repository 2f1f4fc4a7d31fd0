# The learning-rate sweep of sweeps/lr.py without successive halving: every arm trained to
# the end, in four chunks (docs/sweeps.md: 27.5 minutes on 2 CPU cores, one worker).
#   python sweep.py sweeps/lr_all.py
out_dir = 'out-sweep-lr-all'
base = {}
max_steps = 750
chunks = 4
grid = {'learning_rate': [1e-3, 2e-3, 3e-3, 6e-3]}
