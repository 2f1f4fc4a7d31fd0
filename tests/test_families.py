"""Llama 3, Qwen2.5, Qwen3 and Mistral against transformers: tiny random models of each
family, made by transformers itself, load with its logits, save back as the same class,
and generate greedily as it does; converted to ternary at lambda 0 they are unchanged."""
import pytest
import torch

from bitlinear import set_lambda
from engine import generate
from model import ModelConfig, Transformer, rope_frequencies, rope_table

transformers = pytest.importorskip('transformers')

VOCAB, T = 97, 24  # the prompt is longer than Llama 3's original context and the window

# each family as a new user meets it: its own config class, its own quirks
FAMILIES = {
    'llama3': ('LlamaConfig', dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8))),
    'qwen2.5': ('Qwen2Config', dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    'qwen3': ('Qwen3Config', dict(head_dim=16, tie_word_embeddings=True)),  # 4 heads of 16 on a width of 32
    'mistral': ('MistralConfig', dict(sliding_window=6, tie_word_embeddings=False)),
}


def hf_model(family, seed=0, vocab=VOCAB):
    """A 2-layer model of the family with random norm gains and biases (transformers makes
    them 1 and 0, which would hide a misplaced norm or a dropped bias)."""
    name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, name)(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'norm' in n:
                p.uniform_(0.5, 1.5)
            if n.endswith('bias'):
                p.normal_(0, 0.5)
    return model


def tokens(B=2, seed=1):
    return torch.randint(VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(ours, ref, idx):
    with torch.no_grad():
        return (ours(idx) - ref(idx).logits).abs().max().item()


@pytest.mark.parametrize('family', FAMILIES)
def test_loads_with_transformers_logits_and_saves_back_as_the_same_class(tmp_path, family):
    ref = hf_model(family)
    ref.save_pretrained(tmp_path / 'hf')
    ours = Transformer.from_pretrained(str(tmp_path / 'hf')).eval()
    cfg = ours.config
    assert cfg.family == ref.config.model_type
    assert cfg.qkv_bias == (family == 'qwen2.5') and cfg.qk_norm == (family == 'qwen3')
    assert cfg.sliding_window == (6 if family == 'mistral' else 0)
    assert max_diff(ours, ref, tokens()) <= 1e-4
    ours.save_pretrained(tmp_path / 'ours')
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'ours').eval()
    assert type(back) is type(ref)
    assert max_diff(ours, back, tokens(seed=2)) <= 1e-4


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_generation_with_our_kv_cache_equals_transformers(tmp_path, family):
    """Prefill then one token at a time: Mistral's window slides over the cache."""
    ref = hf_model(family, seed=3)
    ref.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    idx = tokens(B=1, seed=4)
    with torch.no_grad():
        want = ref.generate(idx, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        got = generate(ours, idx, 16, temperature=0)
    assert torch.equal(got, want)


def test_llama3_rope_scaling_is_transformers_own_and_matters(tmp_path):
    """The inverse frequencies equal transformers'; the scaling moves most of them, and the logits
    of a prompt longer than the original context differ without it."""
    ref = hf_model('llama3')
    ref.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    theirs = ref.model.rotary_emb.inv_freq
    scaled = rope_frequencies(8, 500000.0, ours.config.rope_scaling)
    plain = rope_frequencies(8, 500000.0)
    assert torch.allclose(scaled, theirs, rtol=1e-6, atol=0)
    assert (scaled != plain).sum() >= 2
    unscaled = Transformer.from_pretrained(str(tmp_path)).eval()
    unscaled.cos, unscaled.sin = rope_table(8, 64, 500000.0)
    assert max_diff(unscaled, ref, tokens()) > 1e-3


def test_mistral_window_is_shorter_than_the_sequence_and_matters(tmp_path):
    ref = hf_model('mistral')
    ref.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    assert ours.config.sliding_window < T
    ours.config.sliding_window = 0  # the whole past: no longer transformers' answer
    assert max_diff(ours, ref, tokens()) > 1e-3


@pytest.mark.parametrize('family', FAMILIES)
def test_converted_at_lambda_0_is_the_fp_model_and_a_ternary_one_saves_and_reloads(tmp_path, family):
    ref = hf_model(family)
    ref.save_pretrained(tmp_path / 'hf')
    fp = Transformer.from_pretrained(str(tmp_path / 'hf')).eval()
    student = Transformer.from_pretrained(str(tmp_path / 'hf')).to_bitnet([tokens()]).eval()
    set_lambda(student, 0.0)
    idx = tokens(seed=5)
    with torch.no_grad():
        assert (student(idx) - fp(idx)).abs().max().item() <= 1e-5
    set_lambda(student, 1.0)
    student.save_pretrained(tmp_path / 'ternary')
    again = Transformer.from_pretrained(str(tmp_path / 'ternary')).eval()
    assert again.config.family == fp.config.family and again.config.bitnet
    with torch.no_grad():
        assert torch.equal(again(idx), student(idx))
    if family != 'llama3':  # transformers' BitNet has none of these layers: it must refuse, not drop them
        with pytest.raises((ValueError, KeyError)):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'ternary')


def test_a_config_that_no_family_can_save_is_refused_in_one_line():
    with pytest.raises(ValueError, match='qkv_bias'):
        ModelConfig(family='qwen2')
    with pytest.raises(ValueError, match='sliding_window'):
        ModelConfig(sliding_window=8)
    with pytest.raises(ValueError, match="rope_scaling 'yarn'"):
        ModelConfig(rope_scaling={'rope_type': 'yarn', 'factor': 4.0})
    with pytest.raises(ValueError, match='family'):
        ModelConfig(family='gemma')


def q8_0_dequantized(w):
    """What llama.cpp reads back from Q8_0: per 32 weights, q = round(w * 127 / max|w|) times
    the fp16 scale max|w| / 127."""
    blocks = w.view(w.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = (blocks * torch.where(d > 0, 1 / d, 0)).round()
    return (q * d.half().float()).view(w.shape)


@pytest.mark.slow
@pytest.mark.parametrize('family', FAMILIES)
def test_llama_cpp_runs_the_fp_and_q8_0_export_of_each_family(tmp_path, family):
    """qwen2 and qwen3 in their own llama.cpp architectures, Llama 3 with its RoPE factors
    (rope_freqs), Mistral within its window: F32 as we compute, Q8_0 as we compute with the
    weights llama.cpp dequantizes (up to its rounding of activations to Q8_0 blocks)."""
    import tokenizer
    from test_gguf import agreement, export
    ref = hf_model(family, vocab=320)
    ref.save_pretrained(tmp_path / 'hf')
    ours = Transformer.from_pretrained(str(tmp_path / 'hf')).eval()
    enc, T = tokenizer.get_tokenizer('bytes'), ours.config.sliding_window or 64
    text = torch.randint(300, (4 * T,), generator=torch.Generator().manual_seed(0)).tolist()
    export(ours, tmp_path / 'f32.gguf', enc)
    diff, top1 = agreement(ours, tmp_path / 'f32.gguf', text, T=T)
    assert diff < 1e-3 and top1 == 1.0, (diff, top1)
    types = {t.name: int(t.tensor_type) for t in export(ours, tmp_path / 'q8_0.gguf', enc, dtype='q8_0').tensors}
    assert types['blk.0.attn_q.weight'] == 8 and types['blk.0.ffn_down.weight'] == 0  # Q8_0; F32 (48 columns)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith('proj.weight') and p.shape[1] % 32 == 0:  # down_proj's 48: F32
                p.copy_(q8_0_dequantized(p))
    diff, top1 = agreement(ours, tmp_path / 'q8_0.gguf', text, T=T)
    assert diff < 2e-2 and top1 >= 0.99, (diff, top1)  # llama.cpp's Q8_0 matmul rounds activations to Q8_0 too


def test_a_ternary_export_of_a_family_llama_cpp_has_no_bitnet_for_is_refused_in_one_line(tmp_path):
    import gguf_export
    import tokenizer
    ref = hf_model('qwen3', vocab=320)
    ref.save_pretrained(tmp_path)
    student = Transformer.from_pretrained(str(tmp_path)).to_bitnet()
    vocab = gguf_export.gguf_vocab(tokenizer.get_tokenizer('bytes'), 320)
    with pytest.raises(ValueError, match="llama.cpp's bitnet model has no qwen3 layers"):
        gguf_export.save_gguf(str(tmp_path / 'm.gguf'), student.state_dict(), student.config, vocab)
    assert not (tmp_path / 'm.gguf').exists()


@pytest.mark.parametrize('config,family', [('config/qwen3.py', 'qwen3'), ('config/llama3.py', 'llama3')])
def test_each_family_config_runs_two_steps_from_a_tiny_model_of_its_family(tmp_path, config, family):
    """A local directory in place of the hub id (model, tokenizer), local text in place of TinyStories;
    a variant we cannot run ends in one line naming its config key."""
    import json
    import math
    import subprocess
    import sys
    from test_data import ROOT, corpus, train_hf_tokenizer
    folder = tmp_path / 'model'
    hf_model(family, vocab=2100).save_pretrained(folder)
    train_hf_tokenizer('qwen2' if family == 'qwen3' else 'llama3', str(folder))
    text = '\n'.join(corpus())
    (tmp_path / 'train.txt').write_text(text[:200_000])
    (tmp_path / 'val.txt').write_text(text[200_000:260_000])
    files = {'train': str(tmp_path / 'train.txt'), 'val': str(tmp_path / 'val.txt')}

    def train(out):
        cmd = [sys.executable, 'train.py', config, f'--init_from={folder}', f'--teacher={folder}', f'--prepare.files={files}',
               f'--dataset={tmp_path / "data"}', f'--out_dir={out}', '--max_steps=2', '--batch_size=2', '--block_size=32',
               '--gradient_accumulation_steps=1', '--eval_interval=2', '--eval_iters=1', '--log_interval=1',
               '--sample.tokens=0', '--compile=False']
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    r = train(tmp_path / 'out')
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = [json.loads(line) for line in open(tmp_path / 'out' / 'log.jsonl')][-1]
    assert last['step'] == 2 and math.isfinite(last['val_loss'])
    assert all(math.isfinite(last[f'loss_{k}']) for k in ('ce', 'kd'))
    if family == 'qwen3':  # BitDistill's last stage: attention relations too
        assert last['w_attn'] == 10 and math.isfinite(last['loss_attn'])
    saved = Transformer.from_pretrained(str(tmp_path / 'out' / 'ckpt_0000002'))
    assert saved.config.family == FAMILIES[family][0].removesuffix('Config').lower() and saved.config.bitnet

    hf = json.loads((folder / 'config.json').read_text())
    if family == 'qwen3':
        hf.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
        key = 'use_sliding_window'
    else:
        hf['rope_parameters'] = dict(hf['rope_parameters'], rope_type='yarn')
        key = 'rope_scaling'
    (folder / 'config.json').write_text(json.dumps(hf))
    r = train(tmp_path / 'refused')
    line = r.stderr.strip()
    assert r.returncode != 0 and '\n' not in line and key in line, line
