# Autoregressive pretraining that turns into a masked-diffusion language model (MDLM / LLaDA).
# With blend = 'linear' each phase starts at its own weights and moves to the next phase's:
# CE alone for the first 40% of steps, then a linear hand-over to the masked-diffusion
# objective (bidirectional attention, t-sampled mask rate, 1/p weight, the dedicated <|mask|>
# token) by 80%, which holds to the end with a little CE so the model stays a causal LM too.
out_dir = 'out-diffusion'
objectives = {'ce': {}, 'diffusion': {}}
curriculum = [(0.4, {'ce': 1.0}), (0.8, {'ce': 1.0}), (1.0, {'ce': 0.2, 'diffusion': 1.0})]
blend = 'linear'
