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


def hf_model(family, seed=0):
    """A 2-layer model of the family with random norm gains and biases (transformers makes
    them 1 and 0, which would hide a misplaced norm or a dropped bias)."""
    name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, name)(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
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
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig(rope_scaling={'rope_type': 'yarn', 'factor': 4.0})
    with pytest.raises(ValueError, match='family'):
        ModelConfig(family='gemma')
