"""BitLinear's quantizers, STE and warmup, each checked against hand-computed values."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from bitlinear import BitLinear, activation_quant, convert_to_bitnet, set_lambda, weight_quant
from model import ModelConfig, Transformer


def test_weight_quant_hand_computed():
    w = torch.tensor([[0.3, -0.05], [0.1, -0.25]])
    w_q, gamma = weight_quant(w)
    assert abs(gamma.item() - 0.175) < 1e-7  # (0.3 + 0.05 + 0.1 + 0.25) / 4
    # |w| / gamma: 1.71 -> 1, 0.29 -> 0, 0.57 -> 1, 1.43 -> 1 (clipped at one)
    assert w_q.tolist() == [[1.0, 0.0], [1.0, -1.0]]


def test_weight_quant_zero_boundary_is_half_gamma():
    # mean |w| = 1, so a weight is zeroed exactly when |w| < 0.5
    w = torch.tensor([0.51, -0.49, 0.499, -0.501, 1.5, -1.5, 1.5, -1.5])
    w_q, gamma = weight_quant(w)
    assert abs(gamma.item() - 1.0) < 1e-6
    assert w_q.tolist() == [1.0, 0.0, 0.0, -1.0, 1.0, -1.0, 1.0, -1.0]


def test_weight_scale_is_clamped_not_shifted():
    # a clamp at 1e-5: gamma of tiny weights is exactly 1e-5, and above the clamp exactly mean|w|
    _, gamma = weight_quant(torch.full((4, 4), 1e-7))
    assert gamma.item() == torch.tensor(1e-5).item()
    _, gamma = weight_quant(torch.full((4, 4), 2e-5))
    assert gamma.item() == torch.tensor(2e-5).item()  # an added epsilon would give 3e-5
    w_q, _ = weight_quant(torch.zeros(3, 3))
    assert (w_q == 0).all()


def test_activation_quant_per_token():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.5, 0.01]])
    x_q, s = activation_quant(x)
    assert s[:, 0].tolist() == [127.0, torch.tensor(127 / 1e-5).item(), 63.5]
    # row 0: 127, -63.5 -> -64 (round half to even), 31.75 -> 32, 0
    assert x_q[0].tolist() == [127.0, -64.0, 32.0, 0.0]
    assert x_q[1].tolist() == [0.0] * 4
    # row 2: scale 63.5: -127, 63.5 -> 64, 31.75 -> 32, 0.635 -> 1
    assert x_q[2].tolist() == [-127.0, 64.0, 32.0, 1.0]


def test_ste_passes_gradients_unchanged():
    torch.manual_seed(0)
    layer = BitLinear(8, 5, bias=True)
    x = torch.randn(3, 8, requires_grad=True)
    g = torch.randn(3, 5)
    (layer(x) * g).sum().backward()
    w_q, gamma = weight_quant(layer.weight)
    x_q, s = activation_quant(x.detach())
    # identity through the quantizers: the gradients of a plain linear evaluated at the quantized values
    assert torch.allclose(x.grad, g @ (w_q * gamma), atol=1e-6)
    assert torch.allclose(layer.weight.grad, g.t() @ (x_q / s), atol=1e-6)
    assert torch.allclose(layer.bias.grad, g.sum(0))


def test_lambda_zero_is_fp_and_one_is_ternary():
    torch.manual_seed(0)
    layer = BitLinear(16, 4, bias=True)
    x = torch.randn(2, 3, 16)
    set_lambda(layer, 0.0)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    set_lambda(layer, 1.0)
    w_q, gamma = weight_quant(layer.weight)
    x_q, s = activation_quant(x)
    assert torch.allclose(layer(x), F.linear(x_q / s, w_q * gamma, layer.bias), atol=1e-6)
    set_lambda(layer, 0.5)
    half = F.linear(x + 0.5 * (x_q / s - x), layer.weight + 0.5 * (w_q * gamma - layer.weight), layer.bias)
    assert torch.allclose(layer(x), half, atol=1e-6)


def test_conversion_keeps_embeddings_and_head_fp_and_adds_two_sublns_per_block():
    cfg = ModelConfig(vocab_size=64, n_layer=3, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48,
                      tie_embeddings=False)
    model = Transformer(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norms_before = sum(isinstance(m, nn.RMSNorm) for m in model.modules())
    model.to_bitnet()
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    assert sum(isinstance(m, BitLinear) for m in model.modules()) == 7 * 3
    assert not any(type(m) is nn.Linear for m in model.layers.modules())
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == norms_before + 2 * 3
    for block in model.layers:
        assert block.self_attn.attn_sub_norm.weight.shape == (32,)
        assert block.mlp.ffn_sub_norm.weight.shape == (48,)
        assert (block.self_attn.attn_sub_norm.weight == 1).all() and (block.mlp.ffn_sub_norm.weight == 1).all()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the latent weights are kept
    assert len(after) == len(before) + 2 * 3
    assert model.config.bitnet and model.config.subln


def test_convert_is_model_agnostic():
    net = nn.Sequential(nn.Linear(4, 4))
    net.q_proj = nn.Linear(4, 4)
    convert_to_bitnet(net)
    assert isinstance(net.q_proj, BitLinear) and type(net[0]) is nn.Linear
