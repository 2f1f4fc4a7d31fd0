# The full-precision twin of the default tiny ternary model: same architecture, data and
# step budget, with nn.Linear instead of BitLinear (and no SubLN), for a fair comparison.
# Its learning rate is the better of 1e-3 and 3e-3 for it (the ternary default's is 1.5e-3,
# the best of 1.5e-3, 3e-3 and 6e-3: see the README's results).
out_dir = 'out-fp'
bitnet = False
learning_rate = 1e-3
min_lr = 1e-4
