"""SmolLM2-135M: the real architecture at full size, and the end-to-end command offline."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from model import ModelConfig, Transformer

# HuggingFaceTB/SmolLM2-135M's config.json, in our names
SMOLLM2_135M = dict(vocab_size=49152, n_layer=30, n_embd=576, n_head=9, n_kv_head=3, intermediate_size=1536,
                    rope_theta=100000.0, norm_eps=1e-5, max_seq_len=8192, tie_embeddings=True, act='silu')


@pytest.mark.slow
def test_full_size_smollm2_builds_converts_and_trains():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SMOLLM2_135M))
    assert model.num_params() == 134_515_008  # the published count, tied embeddings counted once
    model.to_bitnet()
    # SubLN adds two gains per block: 30 * (576 + 1536)
    assert model.num_params() == 134_515_008 + 30 * (576 + 1536)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(49152, (2, 64))
    losses = []
    t0 = time.time()
    for _ in range(3):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"3 steps of the ternary SmolLM2-135M (2 x 63 tokens): {time.time() - t0:.1f} s, losses {losses}")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# SmolLM2-135M's config.json, with only the sizes reduced
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.041666666666666664,
    "intermediate_size": 128, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": True, "vocab_size": 512}
STORY = ("Once upon a time, there was a little {} named {}. {} liked to play in the {} with a {} ball. "
         "One day, {} saw a big {} and said, \"Hello! Do you want to play?\" They played all day and were happy.")


def tiny_stories(n, seed):
    import random
    rng = random.Random(seed)
    words = lambda *a: rng.choice(a)
    stories = []
    for _ in range(n):
        name = words('Lily', 'Tom', 'Sue', 'Max', 'Ben', 'Mia')
        stories.append(STORY.format(words('girl', 'boy', 'dog', 'cat'), name, name.split()[0], words('park', 'garden', 'yard'),
                                    words('red', 'blue', 'shiny'), name, words('bird', 'frog', 'tree', 'truck')))
    return '\n<|endoftext|>\n'.join(stories).encode()


def smollm_hub_files(tmp_path):
    """The hub tree that config/smollm.py reads: SmolLM2's three model files and TinyStories' two text files."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != 'lm_head.weight'}  # tied: stored once
    save_file(state, str(tmp_path / 'model.safetensors'), metadata={'format': 'pt'})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    text = tiny_stories(400, 1).decode()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=500, special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model = 'HuggingFaceTB/SmolLM2-135M/'
    stories = 'datasets/roneneldan/TinyStories/'
    return {model + 'config.json': {'body': json.dumps(SMOLLM2_CONFIG).encode()},
            model + 'model.safetensors': {'body': (tmp_path / 'model.safetensors').read_bytes(), 'lfs': True},
            model + 'tokenizer.json': {'body': tok.to_str().encode()},
            stories + 'TinyStoriesV2-GPT4-train.txt': {'body': tiny_stories(3000, 2), 'lfs': True},
            stories + 'TinyStoriesV2-GPT4-valid.txt': {'body': tiny_stories(200, 3), 'lfs': True}}


@pytest.mark.slow
def test_smollm_command_end_to_end_against_a_local_hub(hub, tmp_path):
    """torchrun --nproc_per_node=2 train.py config/smollm.py --max_steps=10, offline: the model,
    tokenizer and stories come from a hub on 127.0.0.1; the checkpoint opens in transformers."""
    pytest.importorskip('accelerate')
    from transformers import AutoModelForCausalLM
    hub.files.update(smollm_hub_files(tmp_path))
    out, shards = tmp_path / 'out', tmp_path / 'stories'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', 'train.py', 'config/smollm.py',
           '--max_steps=10', f'--out_dir={out}', f'--dataset={shards}', '--batch_size=2', '--block_size=64',
           '--eval_interval=5', '--eval_iters=2', '--log_interval=1', '--sample_tokens=20']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [json.loads(line) for line in open(out / 'log.jsonl')]
    assert [rec['step'] for rec in recs] == list(range(1, 11))
    assert recs[0]['w_kd'] == 0 and recs[-1]['w_kd'] == 1 and recs[-1]['w_attn'] == 10  # CE first, then distillation
    assert all(math.isfinite(recs[-1][k]) and recs[-1][k] > 0 for k in ('loss_ce', 'loss_kd', 'loss_attn'))
    downloads = [p for p, _, _ in hub.log if '/resolve/' in p]
    # the five files and a probe for a shard index (a 404: one file), each asked once: by local rank 0 only
    assert len(downloads) == len(set(downloads)) == 6

    ckpt = str(out / 'ckpt_0000010')
    ours = Transformer.from_pretrained(ckpt).eval()
    assert ours.config.bitnet
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert type(theirs).__name__ == 'BitNetForCausalLM'
    x = torch.randint(500, (2, 24))
    with torch.no_grad(), torch.compiler.set_stance('force_eager'):
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff < 1e-4, diff
    r = subprocess.run([sys.executable, 'sample.py', f'--ckpt={ckpt}', '--num_tokens=16', '--prompt=Once upon a time'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith('Once upon a time') and 'tokens/s' in r.stdout


def test_smollm_command_offline_fails_fast_in_one_line(tmp_path):
    """No network and no HF_ENDPOINT: one line naming the URL and the way to use a local copy."""
    env = {k: v for k, v in os.environ.items() if k != 'HF_ENDPOINT'}
    env.update(NANOBITNET_CACHE=str(tmp_path / 'cache'), HTTPS_PROXY='http://127.0.0.1:9', HTTP_PROXY='http://127.0.0.1:9')
    t0 = time.time()
    r = subprocess.run([sys.executable, 'train.py', 'config/smollm.py', '--max_steps=10', f'--out_dir={tmp_path / "o"}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and time.time() - t0 < 30
    line = r.stderr.strip()
    assert '\n' not in line, line
    assert 'https://huggingface.co/HuggingFaceTB/SmolLM2-135M/resolve/main/' in line and 'local' in line, line
