# BitDistill (Wu et al. 2025) on the offline corpus: a ternary student learns from its own
# full-precision self. Train the teacher first: python train.py config/tiny_fp.py
# Stage 1, modeling refinement: the student starts from the fp weights, converted to BitNet
#   with SubLN (init_from + bitnet=True).
# Stage 2, continued pretraining: cross-entropy only, for the first 40% of the steps.
# Stage 3, distillation: CE + logits KD (T = 5) + attention-relation KD on the last layer.
# The weights keep the three terms within an order of magnitude of each other (each term is
# logged as loss_ce, loss_kd, loss_attn; see the README for the measured values).
out_dir = 'out-bitdistill'
init_from = 'out-fp'    # the latest checkpoint of the fp twin's run
teacher = 'out-fp'      # the same fp model, frozen
bitnet = True
objectives = {'ce': {}, 'kd': {'temperature': 5.0}, 'attn': {'layer': -1, 'heads': 4}}
curriculum = [(0.4, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'attn': 10.0})]
learning_rate = 1.5e-3
min_lr = 1.5e-4
warmup_steps = 10
