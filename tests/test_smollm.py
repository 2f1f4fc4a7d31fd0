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

import bitlinear
from conftest import ROOT
from engine import fuse, generate
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
def test_smollm_command_end_to_end_against_a_local_hub(hub_server, tmp_path):
    """torchrun --nproc_per_node=2 train.py config/smollm.py --max_steps=10, offline: the model,
    tokenizer and stories come from a hub on 127.0.0.1; the checkpoint, one weight scale per output
    row, saves under our own model_type and opens in our model and sample.py."""
    hub_server.files.update(smollm_hub_files(tmp_path))
    out, shards = tmp_path / 'out', tmp_path / 'stories'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', 'train.py', 'config/smollm.py',
           '--max_steps=10', f'--out_dir={out}', f'--dataset={shards}', '--batch_size=2', '--block_size=64',
           '--eval_interval=5', '--eval_iters=2', '--log_interval=1', '--sample.tokens=20']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [json.loads(line) for line in open(out / 'log.jsonl')]
    assert [rec['step'] for rec in recs] == list(range(1, 11))
    # block-wise reconstruction for the first third, then CE + KD; two ranks run it under FSDP
    assert recs[0]['w_block'] == 1 and recs[0]['w_ce'] == recs[0]['w_kd'] == 0
    assert recs[-1]['w_block'] == 0 and recs[-1]['w_ce'] == recs[-1]['w_kd'] == 1
    assert math.isfinite(recs[0]['loss_block']) and recs[0]['loss_block'] > 0
    assert all(math.isfinite(recs[-1][k]) and recs[-1][k] > 0 for k in ('loss_ce', 'loss_kd'))
    downloads = [p for p, _, _ in hub_server.log if '/resolve/' in p]
    # the five files and probes (404s) for a shard index and the two chat-template files, each asked
    # once: by local rank 0 only
    assert len(downloads) == len(set(downloads)) == 8

    ckpt = str(out / 'ckpt_0000010')
    assert json.load(open(os.path.join(ckpt, 'config.json')))['model_type'] == 'bitnet_llama'
    ours = Transformer.from_pretrained(ckpt).eval()
    assert ours.config.bitnet and ours.config.weight_scale == 'row'
    q_proj = ours.layers[0].self_attn.q_proj
    gamma = q_proj.weight.abs().mean(1)  # absmean per output row, as weight_quant takes it
    assert bitlinear.quantized_weight(q_proj)[1].reshape(-1).equal(gamma.clamp(min=1e-5))
    assert gamma.max() > gamma.min() * 1.01  # the rows' scales differ: not one per matrix
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


# ---------------------------------------------------------------- the real model: SmolLM2-135M-Instruct

@pytest.fixture(scope='module')
def real():
    """The real pretrained model as a Hugging Face directory (tests/smollm2.py; made once, cached)."""
    for extra in ('gguf', 'transformers', 'tokenizers'):
        pytest.importorskip(extra)
    from smollm2 import smollm2
    return smollm2()


def real_texts():
    import inspect
    import json as json_module
    from pydoc_data.topics import topics
    return [topics['with'][:3000], inspect.getsource(json_module.dumps),  # English with code; Python source
            'In 2024, 1234567 people paid $3.14159 each (10,000.5 in all) on 2024-11-24T05:21:12Z.',
            'naïve café — 東京 🚀 Ελληνικά, ﬁ ligature, e\u0301, \u00a0non-breaking,\ttab\r\n  trailing   ',
            '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|endoftext|>']


@pytest.mark.slow
def test_real_tokenizer_ids_equal_hf_tokenizers(real):
    from tokenizers import Tokenizer
    from tokenizer import get_tokenizer
    theirs, ours = Tokenizer.from_file(os.path.join(real, 'tokenizer.json')), get_tokenizer(real)
    for text in real_texts():
        assert ours.encode(text, allowed_special='all') == theirs.encode(text, add_special_tokens=False).ids, text[:60]
    assert ours.encode_ordinary('2024') == [ours.encode_single_token(d) for d in '2024']  # SmolLM2 splits digits


@pytest.mark.slow
def test_real_model_logits_and_greedy_answer_equal_transformers(real):
    from transformers import AutoModelForCausalLM
    from tokenizer import chat_prompt, get_tokenizer
    enc = get_tokenizer(real)
    ours, theirs = Transformer.from_pretrained(real).eval(), AutoModelForCausalLM.from_pretrained(real).eval()
    x = torch.tensor([enc.encode(''.join(real_texts()), allowed_special='all')[:200]])
    with torch.no_grad():
        diff = (ours(x) - theirs(x).logits).abs().max().item()
    assert diff < 1e-4, diff
    prompt = torch.tensor([chat_prompt(enc, 'What is the capital of France?')])
    with torch.no_grad():
        a = generate(ours, prompt, 12, temperature=0, eos_id=enc.encode_single_token('<|im_end|>'))[0, prompt.size(1):]
        b = theirs.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.size(1):]
    assert a.tolist() == b.tolist() and 'Paris' in enc.decode(a.tolist())


@pytest.mark.slow
def test_real_model_converted_at_lambda_0_keeps_its_held_out_loss(real):
    """Conversion inserts SubLN; at lambda 0 the converted model must still be the pretrained one.
    Calibrated gains also keep it close with the norms at full strength, where gain 1 breaks it."""
    from bitlinear import SubLN, set_lambda
    from tokenizer import get_tokenizer
    from data import offline_corpus
    train, val = (torch.from_numpy(t[:2049].astype('int64')) for t in offline_corpus(get_tokenizer(real)))

    @torch.no_grad()
    def heldout(m):  # nats per token, 4 windows of 512 held-out tokens
        return F.cross_entropy(m(val[:-1].view(4, 512)).flatten(0, 1), val[1:]).item()
    teacher = heldout(Transformer.from_pretrained(real))
    assert 2.0 < teacher < 3.0, teacher
    calib = [train[i:i + 512][None] for i in range(0, 2048, 512)]  # training text, never the held-out split
    losses = {}
    for kind in ('calibrated', 'gain 1'):
        student = Transformer.from_pretrained(real).to_bitnet(calib if kind == 'calibrated' else ())
        set_lambda(student, 0.0)
        losses[kind, 0] = heldout(student)
        for m in student.modules():  # the norms at full strength, the weights still fp
            if isinstance(m, SubLN):
                m.lam.fill_(1.0)
        losses[kind, 1] = heldout(student)
    print(f"held-out nats/token: teacher {teacher:.4f}; {losses}")
    assert abs(losses['calibrated', 0] - teacher) < 0.05 and abs(losses['gain 1', 0] - teacher) < 0.05
    assert losses['calibrated', 1] < teacher + 3 < losses['gain 1', 1]


@pytest.mark.slow
def test_real_model_upcycled_to_a_ternary_moe_keeps_its_held_out_loss_at_lambda_0(real):
    """Sparse upcycling as train.py does it (8 copies of each MLP, top 2, then BitNet with calibrated
    SubLN): at lambda 0 the MoE is the pretrained model, in fp to 1e-3 in the logits, and in held-out
    loss to 0.05 nats per token after conversion."""
    from bitlinear import set_lambda
    from tokenizer import get_tokenizer
    from data import offline_corpus
    train, val = (torch.from_numpy(t[:2049].astype('int64')) for t in offline_corpus(get_tokenizer(real)))
    x, y = val[:-1].view(4, 512), val[1:]
    dense = Transformer.from_pretrained(real)
    with torch.no_grad():
        want = dense(x)
        moe = dense.upcycle(8, 2)
        assert (moe(x) - want).abs().max() < 1e-3  # logits up to ~20: w * MLP + (1 - w) * MLP in fp32
    calib = [train[i:i + 512][None] for i in range(0, 2048, 512)]
    student = moe.to_bitnet(calib)
    set_lambda(student, 0.0)
    with torch.no_grad():
        teacher = F.cross_entropy(want.flatten(0, 1), y).item()
        upcycled = F.cross_entropy(student(x).flatten(0, 1), y).item()
    print(f"held-out nats/token: dense {teacher:.4f}, upcycled ternary MoE at lambda 0 {upcycled:.4f}")
    assert abs(upcycled - teacher) < 0.05


@pytest.mark.slow
def test_real_model_int8_head_keeps_held_out_loss_and_greedy_answers(real):
    """engine.fuse gives the head int8 rows (4x fewer bytes per token). On the real model, that
    must barely change what it says: held-out loss within 0.01 nats; greedy chat answers the same for
    their first 16 tokens (measured: the third answer takes another turn after 22 tokens)."""
    from tokenizer import chat_prompt, get_tokenizer
    from data import offline_corpus
    enc = get_tokenizer(real)
    val = torch.from_numpy(offline_corpus(enc)[1][:2049].astype('int64'))
    fp = Transformer.from_pretrained(real).eval()
    int8 = fuse(Transformer.from_pretrained(real).eval())
    from engine import Int8Head
    assert type(fp.lm_head) is not Int8Head and type(int8.lm_head) is Int8Head
    with torch.no_grad():
        loss = [F.cross_entropy(m(val[:-1].view(4, 512)).flatten(0, 1), val[1:]).item() for m in (fp, int8)]
    print(f"held-out nats/token: fp head {loss[0]:.4f}, int8 head {loss[1]:.4f}")
    assert abs(loss[0] - loss[1]) < 0.01, loss
    end = enc.encode_single_token('<|im_end|>')
    for question in ('What is the capital of France?', 'Write a Python function that reverses a string.',
                     'Give me three tips for staying focused.'):
        prompt = torch.tensor([chat_prompt(enc, question)])
        a, b = (generate(m, prompt, 16, temperature=0, eos_id=end)[0, prompt.size(1):].tolist() for m in (fp, int8))
        assert a == b, (question, enc.decode(a), enc.decode(b))
