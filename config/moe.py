# A small ternary mixture of experts trained from scratch on the offline corpus, on the CPU:
# the default model's 4 blocks with 8 experts per MLP, each token routed to 2 of them
# (docs/moe.md). About 7 minutes on 2 cores.
#   python train.py config/moe.py
#   python train.py config/moe.py --out_dir=out-moe-lb0 "--objectives={'ce': {}, 'router': {'load_balance': 0}}"
out_dir = 'out-moe'
moe = dict(n_experts=8, top_k=2, n_shared_experts=0, norm_topk_prob=True,
           moe_intermediate_size=256)
# CE plus the router losses. The load-balance coefficient is 0.1, not the default 0.01: after
# 750 steps the busiest expert holds 1.15x the mean load at 0.1, 1.8x at 0.01 (docs/moe.md)
objectives = {'ce': {}, 'router': {'load_balance': 0.1}}
curriculum = [(1.0, {'ce': 1.0, 'router': 1.0})]
