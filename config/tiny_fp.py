# The full-precision twin of the default tiny ternary model: same architecture, data and
# step budget, with nn.Linear instead of BitLinear (and no SubLN), for a fair comparison.
# fp models want a smaller learning rate than ternary ones (BitNet b1.58 trains at 1.5e-3
# to 4e-3 where its fp baseline uses about 1/3 of that).
out_dir = 'out-fp'
bitnet = False
learning_rate = 1e-3
min_lr = 1e-4
