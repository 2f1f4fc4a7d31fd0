# A small ternary mixture of experts trained from scratch on the offline corpus, on the CPU:
# the default model's 4 blocks with 8 experts per MLP, each token routed to 2 of them.
#   python train.py config/moe.py
#   python train.py config/moe.py --objectives="{'ce': {}, 'router': {'load_balance': 0}}"
out_dir = 'out-moe'
moe = dict(n_experts=8, top_k=2, n_shared_experts=0, norm_topk_prob=True,
           moe_intermediate_size=256)
# CE, plus the router losses at their defaults (load balance 0.01, z-loss 0.001, aux 0)
objectives = {'ce': {}, 'router': {}}
curriculum = [(1.0, {'ce': 1.0, 'router': 1.0})]
