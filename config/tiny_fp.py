# The full-precision twin of the default tiny ternary model: same architecture, data and
# step budget, with nn.Linear instead of BitLinear (and no SubLN), for a fair comparison.
# fp models usually want a lower LR than ternary ones (the ternary default uses 3e-3).
out_dir = 'out-fp'
bitnet = False
learning_rate = 1e-3
min_lr = 1e-4
