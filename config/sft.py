# Chat fine-tuning (SFT) of SmolLM2-135M turned ternary, on SlimOrca (Lian et al. 2023):
# 518k conversations (system, human, gpt) checked against FLAN's answers, in one ShareGPT
# jsonl file of about 1 GB. The first run fetches the model (about 270 MB) and the file, and
# renders every conversation in ChatML with SmolLM2's own <|im_start|> and <|im_end|> tokens;
# the loss counts only the assistant's answers and their <|im_end|> (data.py, render_chat).
# One conversation in 100 is held out for val. The quantization ramps in over the first 10%
# of the steps, since switching a pretrained model to ternary at once undoes its training.
out_dir = 'out-sft'
init_from = 'HuggingFaceTB/SmolLM2-135M'
dataset = 'data/slimorca-smollm2'
prepare = dict(files={'train': 'hf://datasets/Open-Orca/SlimOrca/oo-labeled_correct.gpt4.sharegpt.jsonl'},
               format='chat')
bitnet = True
lambda_warmup = 0.1
block_size = 1024
batch_size = 8
gradient_accumulation_steps = 8
max_steps = 2000
learning_rate = 1e-3
min_lr = 1e-4
warmup_steps = 100
eval_interval = 200
