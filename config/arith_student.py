# Task-specific conversion, stage 2 of 2 (docs/task_conversion.md): the ternary student.
# BitDistill (Wu et al. 2025) on one task: the fp teacher of config/arith_teacher.py,
# converted to BitNet with SubLN (gains calibrated on the first batches), learns on the
# task's training prompts from that same teacher, frozen:
# - for the first quarter of the steps, block-wise reconstruction alone: each block, fed
#   the fp block's input, learns to give its output, on every token of prompt and answer;
# - then the cross-entropy on the answers, logits KD on the answers (T = 5) and
#   attention-relation KD on the last layer (every token), AdamW's moments afresh; at
#   weight 1, not config/bitdistill.py's 10, under which it was most of the loss
#   (docs/task_conversion.md: both runs measured).
#   python train.py config/arith_student.py
#   python rl.py --ckpt=out-arith-student                     # its held-out accuracy
# The baselines on the same tokens and steps (docs/task_conversion.md): the CE alone,
#   --objectives="{'ce': {}}" --curriculum="[(1.0, {'ce': 1.0})]" --teacher=''
# and, with that, a ternary model of the same shape from random weights:
#   --init_from=scratch --tokenizer=out-arith-teacher "--arch={'n_layer': 30, 'n_embd': 576,
#   'n_head': 9, 'n_kv_head': 3, 'intermediate_size': 1536, 'act': 'silu',
#   'rope_theta': 100000.0, 'tie_embeddings': True}"  (the teacher's shape)
out_dir = 'out-arith-student'
init_from = 'out-arith-teacher'
teacher = 'out-arith-teacher'
bitnet = True
weight_scale = 'row'
dataset = 'data/arithmetic-splits-smollm2'
prepare = dict(files={'train': 'arithmetic_sft_train', 'val': 'arithmetic_sft_val'},
               format='chat')  # rl.py's files, made when the run starts
objectives = {'block': {}, 'ce': {}, 'kd': {'temperature': 5.0},
              'attn': {'layer': -1, 'heads': 4}}
curriculum = [(0.25, {'block': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'attn': 1.0})]
batch_size = 16
block_size = 96
max_steps = 360        # 552,960 tokens, 56-59 minutes on 2 CPU cores (docs/task_conversion.md)
warmup_steps = 10
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.0
eval_interval = 50
eval_iters = 4
sample = dict(tokens=0)
