"""The model against transformers (the reference implementation), and its own invariants."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from model import ModelConfig, Transformer

transformers = pytest.importorskip('transformers')


def hf_llama(tie, vocab=101, hidden=36, heads=9, kv_heads=3, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=52, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=100000.0,
                                   rms_norm_eps=1e-5, tie_word_embeddings=tie, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1; random gains catch a misplaced norm
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.uniform_(0.5, 1.5)
    return model


def tokens(vocab, B=2, T=17, seed=1):
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize('tie', [True, False])
def test_loads_hf_llama_with_same_logits(tmp_path, tie):
    ref = hf_llama(tie)
    ref.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    assert ours.config.n_head == 9 and ours.config.n_kv_head == 3 and ours.config.tie_embeddings == tie
    idx = tokens(101)
    with torch.no_grad():
        diff = (ours(idx) - ref(idx).logits).abs().max().item()
    assert diff <= 1e-4


def test_save_pretrained_round_trips_to_hf_llama(tmp_path):
    ours = Transformer(ModelConfig(vocab_size=70, n_layer=2, n_embd=48, n_head=6, n_kv_head=2, intermediate_size=40,
                                   tie_embeddings=False, rope_theta=500000.0)).eval()
    ours.save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(ref).__name__ == 'LlamaForCausalLM'
    idx = tokens(70)
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max().item() <= 1e-4


def test_sharded_bf16_checkpoint(tmp_path):
    ref = hf_llama(tie=False).to(torch.bfloat16)
    ref.save_pretrained(tmp_path, max_shard_size='20KB')
    assert os.path.exists(tmp_path / 'model.safetensors.index.json')
    ours = Transformer.from_pretrained(str(tmp_path))
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        hf_k = k if k.startswith('lm_head') else 'model.' + k
        assert torch.equal(v, ref_sd[hf_k].float()), k  # bf16 -> fp32 is exact


def bitnet_logits_hf(path, idx):
    # transformers wraps its BitNet quantizers in torch.compile; eager gives the same numbers faster
    with torch.compiler.set_stance('force_eager'), torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        return type(ref).__name__, ref(idx).logits


def test_ternary_model_loads_in_transformers_as_bitnet(tmp_path):
    pytest.importorskip('accelerate')
    ours = Transformer(ModelConfig(vocab_size=90, n_layer=2, n_embd=64, n_head=8, n_kv_head=2, intermediate_size=80,
                                   bitnet=True, act='relu2')).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if 'norm' in name:
                p.uniform_(0.5, 1.5)
    ours.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / 'config.json'))
    assert cfg['quantization_config'] == {'quant_method': 'bitnet', 'linear_class': 'autobitlinear',
                                          'quantization_mode': 'online'}
    idx = tokens(90)
    name, ref = bitnet_logits_hf(tmp_path, idx)
    assert name == 'BitNetForCausalLM'
    with torch.no_grad():
        assert (ours(idx) - ref).abs().max().item() <= 1e-4


def test_hf_bitnet_loads_with_same_logits(tmp_path):
    pytest.importorskip('accelerate')
    torch.manual_seed(0)
    cfg = transformers.BitNetConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, hidden_act='silu',
                                    tie_word_embeddings=True)
    cfg.quantization_config = {'quant_method': 'bitnet', 'linear_class': 'autobitlinear', 'quantization_mode': 'online'}
    transformers.BitNetForCausalLM(cfg).save_pretrained(tmp_path)
    cfg_json = json.load(open(tmp_path / 'config.json'))
    assert cfg_json['model_type'] == 'bitnet'
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    assert ours.config.bitnet and ours.config.subln and ours.config.act == 'silu'
    idx = tokens(80)
    _, ref = bitnet_logits_hf(tmp_path, idx)
    with torch.no_grad():
        assert (ours(idx) - ref).abs().max().item() <= 1e-4


def test_generate_with_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=40,
                                    bitnet=True)).eval()
    idx = tokens(50, B=2, T=5)
    out = model.generate(idx, 12, temperature=0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], idx)
    with torch.no_grad():  # greedy decoding re-derived without a cache, one full forward per token
        seq = idx
        for _ in range(12):
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, seq)


def test_fuse_changes_only_the_head_and_saves_the_same_checkpoint(tmp_path):
    """Transformer.fuse: fused q/k/v and gate/up give every block's output bit for bit (each row keeps
    its matrix's gamma); the head becomes int8 rows, checked against its definition computed here;
    state_dict (and so save_pretrained) is what it was; generation with the cache matches."""
    from kernels import quantize
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96, bitnet=True)
    model = Transformer(cfg).eval().freeze()
    idx = tokens(300, B=2, T=9)
    with torch.no_grad():
        ref = {'hidden': []}
        want_logits = model(idx, feats=ref)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.fuse()
        got = {'hidden': []}
        logits = model(idx, feats=got)
    assert all(m.fused is not None for b in model.layers for m in (b.self_attn, b.mlp))
    assert all(torch.equal(a, b) for a, b in zip(ref['hidden'], got['hidden']))
    h = model.norm(got['hidden'][-1]).reshape(-1, 64)
    W = model.lm_head.weight
    scale = W.abs().amax(1) / 127
    x_q, s = quantize(h, 32767)  # int16 per token times int8 per row, exact int64 sums, scaled once
    int8_head = (x_q.long() @ (W / scale[:, None]).round().long().T).float() * (scale / s)
    assert torch.equal(logits.reshape(-1, 300), int8_head)
    assert (logits - want_logits).abs().max() < 0.01 * want_logits.abs().max()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    model.save_pretrained(tmp_path)
    again = Transformer.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(idx), want_logits)
        seq = idx
        for _ in range(6):  # greedy decoding without a cache, one full forward per token
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(model.generate(idx, 6, temperature=0), seq)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='no config.json'):
        Transformer.from_pretrained(str(tmp_path / 'missing'))
    hf_llama(tie=True).save_pretrained(tmp_path)
    with open(tmp_path / 'model.safetensors', 'r+b') as f:
        f.truncate(200)
    with pytest.raises(ValueError, match='cannot read .*model.safetensors'):
        Transformer.from_pretrained(str(tmp_path))
    save_file({'model.embed_tokens.weight': torch.zeros(101, 36)}, tmp_path / 'model.safetensors')
    with pytest.raises(ValueError, match='does not match its config.json: missing'):
        Transformer.from_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / 'config.json'))
    json.dump({**cfg, 'model_type': 'gpt2'}, open(tmp_path / 'config.json', 'w'))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Transformer.from_pretrained(str(tmp_path))


def test_lrc_checkpoint_loads_here_and_is_refused_by_transformers(tmp_path):
    """transformers has no low-rank corrections: it must refuse such a checkpoint, not open it without
    them (logits off by 0.26 when it did); ours loads it with the corrections, packed or not."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48,
                                    max_seq_len=32, bitnet=True)).add_lrc(4).eval()
    idx = tokens(64)
    for kind in ('online', 'packed'):
        model = model.freeze() if kind == 'packed' else model
        model.save_pretrained(tmp_path / kind)
        assert json.load(open(tmp_path / kind / 'config.json'))['model_type'] == 'bitnet_lrc'
        with pytest.raises((ValueError, KeyError)):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind)
        loaded = Transformer.from_pretrained(str(tmp_path / kind)).eval()
        assert loaded.config.lrc_rank == 4 and loaded.config.packed == (kind == 'packed')
        with torch.no_grad():
            assert torch.equal(loaded(idx), model(idx))
