# Task-specific conversion on real text (docs/task_conversion.md): ARC-Easy.
# SmolLM2-135M-Instruct, converted to BitNet with SubLN (per-row weight scales), learns
# from itself in fp, frozen, on the questions of ARC-Easy's test split: each question
# followed by each of its choices, as eval.py scores a choice (0-shot), with no word of
# which one is right. What the student learns of the answers is the teacher's
# distributions on those texts. BitDistill (Wu et al. 2025), on every token:
# - for the first quarter of the steps, block-wise reconstruction alone;
# - then logits KD (T = 5) and the attention relations of the last layer, as
#   config/arith_student.py. No CE: the texts hold the wrong choices too.
# The student has seen the test split's questions; it is scored on the 570 questions of
# the validation split, which no training text holds (tests/test_task_conversion.py).
#   python train.py config/arc_student.py --init_from=DIR --teacher=DIR   # offline: a folder
#   python eval.py --ckpt=out-arc-student --tasks=arc_easy               # acc, acc_norm
out_dir = 'out-arc-student'
init_from = 'HuggingFaceTB/SmolLM2-135M-Instruct'
teacher = 'HuggingFaceTB/SmolLM2-135M-Instruct'
bitnet = True
weight_scale = 'row'
dataset = 'data/arc-easy-test-smollm2'
# the choice texts eval.choice_texts_file makes, when the run starts
prepare = dict(files={'train': 'arc_easy-test_rc_5shot-choices'}, format='jsonl')
objectives = {'block': {}, 'kd': {'temperature': 5.0}, 'attn': {'layer': -1, 'heads': 4}}
curriculum = [(0.25, {'block': 1.0}), (1.0, {'kd': 1.0, 'attn': 1.0})]
batch_size = 16
block_size = 96
max_steps = 200        # 307,200 tokens, about 0.9 of the test split's choice texts
warmup_steps = 10
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.0
eval_interval = 50
eval_iters = 4
sample = dict(tokens=0)
