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


def test_an_rms_norm_before_every_linear_keeps_lambda_0_and_opens_in_transformers_as_use_rms_norm(tmp_path):
    """BitDistill's norm on the input of every BitLinear: calibrated with SubLN, it leaves the converted model
    exactly itself at lambda 0; at lambda 1 transformers' BitNet with use_rms_norm computes what ours does,
    online and packed; llama.cpp's bitnet has no such norm, so its export is refused in one line."""
    pytest.importorskip('accelerate')
    import gguf_export
    from bitlinear import SubLN, set_lambda
    hf_llama(tie=True, hidden=64, heads=8, kv_heads=2).save_pretrained(tmp_path / 'fp')
    fp = Transformer.from_pretrained(str(tmp_path / 'fp')).eval()
    idx = tokens(101)
    student = Transformer.from_pretrained(str(tmp_path / 'fp')).to_bitnet([tokens(101, seed=2)], linear_norm=True)
    student.eval()
    norms = [m.rms_norm for m in student.modules() if getattr(m, 'rms_norm', None) is not None]
    assert len(norms) == 2 * 7 and all(isinstance(n, SubLN) and (n.weight != 1).any() for n in norms)
    set_lambda(student, 0.0)
    with torch.no_grad():
        assert (student(idx) - fp(idx)).abs().max().item() <= 1e-5
    set_lambda(student, 1.0)
    student.save_pretrained(tmp_path / 'online')
    quant = json.load(open(tmp_path / 'online' / 'config.json'))['quantization_config']
    assert quant['use_rms_norm'] and quant['rms_norm_eps'] == 1e-5
    name, ref = bitnet_logits_hf(tmp_path / 'online', idx)
    with torch.no_grad():
        ours = student(idx)
        assert name == 'BitNetForCausalLM' and (ours - ref).abs().max().item() <= 1e-4
        assert torch.equal(Transformer.from_pretrained(str(tmp_path / 'online'))(idx), ours)
        student.freeze().save_pretrained(tmp_path / 'packed')
        packed = Transformer.from_pretrained(str(tmp_path / 'packed')).eval()
        assert packed.config.packed and packed.config.linear_norm
        assert (packed(idx) - ours).abs().max().item() <= 1e-4
    name, ref = bitnet_logits_hf(tmp_path / 'packed', idx)
    assert (ref - ours).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match=r"has no an RMSNorm before every linear \(linear_norm\)"):
        gguf_export.save_gguf(str(tmp_path / 'm.gguf'), student.state_dict(), student.config, {})


@pytest.mark.parametrize('scales,width', [('row', 64), ('block', 256)])
def test_a_model_with_finer_scales_saves_under_our_own_type_and_packs(tmp_path, scales, width):
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(vocab_size=90, n_layer=2, n_embd=width, n_head=4, n_kv_head=2,
                                   intermediate_size=96 if scales == 'row' else 512, bitnet=True,
                                   weight_scale=scales)).eval()
    idx = tokens(90)
    ours.save_pretrained(tmp_path / 'online')
    cfg = json.load(open(tmp_path / 'online' / 'config.json'))
    assert cfg['model_type'] == 'bitnet_llama' and cfg['weight_scale'] == scales
    with pytest.raises((ValueError, KeyError)):  # transformers' BitNet has one scale per matrix: refused, not run
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'online')
    with torch.no_grad():
        want = ours(idx)
        assert torch.equal(Transformer.from_pretrained(str(tmp_path / 'online'))(idx), want)
        ours.freeze().save_pretrained(tmp_path / 'packed')
        packed = Transformer.from_pretrained(str(tmp_path / 'packed')).eval()
        mlp = packed.layers[0].mlp
        if scales == 'row':
            assert mlp.up_proj.weight_scale.shape == (96,)
        else:  # one block of 256 inputs is one gamma per row; 512 inputs, two
            assert mlp.up_proj.weight_scale.shape == (512,) and mlp.down_proj.weight_scale.shape == (256, 2)
        assert (packed(idx) - want).abs().max().item() <= 1e-5
    if scales == 'block':  # every input width must be a multiple of 256
        with pytest.raises(ValueError, match=r"multiple of 256, and this model's are \[256, 576\]: use 'row'"):
            ModelConfig(vocab_size=90, n_layer=2, n_embd=256, n_head=4, n_kv_head=2, intermediate_size=576,
                        bitnet=True, weight_scale='block')
