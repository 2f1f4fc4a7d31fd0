# A small ternary mixture of experts trained from scratch on the offline corpus, on the CPU:
# the default model's 4 blocks with 8 experts per MLP, each token routed to 2 of them
# (docs/moe.md). About 7 minutes on 2 cores.
#   python train.py config/moe.py
#   python train.py config/moe.py --out_dir=out-moe-lb0 "--objectives={'ce': {}, 'router': {'load_balance': 0}}"
out_dir = 'out-moe'
moe = dict(n_experts=8, top_k=2, n_shared_experts=0, norm_topk_prob=True,
           moe_intermediate_size=256)
# CE plus the router losses. The load-balance coefficient is 0.05, not the default 0.01: at
# 0.01 the busiest expert still held 1.8x the mean load after 750 steps, at 0.05 1.4x
objectives = {'ce': {}, 'router': {'load_balance': 0.05}}
curriculum = [(1.0, {'ce': 1.0, 'router': 1.0})]
