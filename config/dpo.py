# DPO (Rafailov et al. 2023) on a trained model: it learns to prefer the chosen answer of each
# pair over the rejected one, relative to its frozen starting point (the teacher), while CE on
# the corpus keeps its language modeling. Train a model first (python train.py), then:
#   python train.py config/dpo.py
# config/preferences.jsonl holds 128 pairs made from the offline corpus: a sentence's real
# continuation (chosen) against the same words shuffled (rejected). loss_dpo starts
# at ln 2 = 0.693 (policy = reference) and falls as the margin grows.
out_dir = 'out-dpo'
init_from = 'out'      # the latest checkpoint of the default run
teacher = 'out'        # the same model, frozen: DPO's reference policy
dpo_data = 'config/preferences.jsonl'
objectives = {'ce': {}, 'dpo': {'beta': 0.1}}
curriculum = [(1.0, {'ce': 1.0, 'dpo': 1.0})]
max_steps = 100
warmup_steps = 10
learning_rate = 3e-4
min_lr = 3e-5
eval_interval = 25
