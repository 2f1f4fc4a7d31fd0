# Task-specific conversion, stage 1 of 2 (docs/task_conversion.md): the fp teacher.
# SmolLM2-135M-Instruct fine-tuned on rl.py's offline arithmetic task: its 5,000 training
# problems as chat rows, each answered `#### <number>`, the loss on the answers only.
#   python train.py config/arith_teacher.py
#   python train.py config/arith_teacher.py --init_from=DIR   # offline: a folder with the model
#   python rl.py --ckpt=out-arith-teacher                     # its held-out accuracy, greedy
# Stage 2 converts it to ternary and distils it on the same prompts: config/arith_student.py.
out_dir = 'out-arith-teacher'
init_from = 'HuggingFaceTB/SmolLM2-135M-Instruct'
bitnet = False
dataset = 'data/arithmetic-splits-smollm2'
prepare = dict(files={'train': 'arithmetic_sft_train', 'val': 'arithmetic_sft_val'},
               format='chat')  # rl.py's files, made when the run starts
batch_size = 16
block_size = 96        # a chat row is about 70 tokens
max_steps = 60
warmup_steps = 5
learning_rate = 1e-4
min_lr = 1e-5
weight_decay = 0.0
eval_interval = 30
eval_iters = 4
sample = dict(tokens=0)
