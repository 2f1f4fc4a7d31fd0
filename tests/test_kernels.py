"""kernels.py and packed inference: the two 2-bit layouts, the four matmul paths against exact
integer arithmetic, PackedBitLinear / freeze, and the offline BitNet export against transformers."""
import gc
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitlinear
import kernels
from bitlinear import BitLinear, PackedBitLinear, activation_quant, freeze, weight_quant
from model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
has_cxx = shutil.which(os.environ.get('CXX', 'c++')) is not None
# (M tokens, N outputs, K inputs): batch 1 and odd batches, K not a multiple of any vector width;
# K = 1100: decode's one-row-at-a-time path for long rows
SHAPES = [(1, 8, 256), (1, 13, 100), (3, 7, 300), (5, 64, 1000), (17, 33, 64), (2, 9, 1100)]


def ternary(N, K, seed=0):
    return torch.randint(-1, 2, (N, K), generator=torch.Generator().manual_seed(seed)).to(torch.int8)


def int_inputs(M, K, seed=1):
    """Integer activations whose absmax is 127 (so s = 1 and x_q = x), with an all-zero row and a
    row at +-127 everywhere: with gamma = 1 the op's output is its int32 accumulation."""
    x = torch.randint(-127, 128, (M, K), generator=torch.Generator().manual_seed(seed)).float()
    x[:, 0] = 127.0
    x[0] = 0.0
    if M > 2:
        x[2] = torch.where(torch.arange(K) % 2 == 0, 127.0, -127.0)
    return x


@pytest.fixture(scope='module')
def cpp():
    """One build of the C++ extension for the whole module (torch caches it across runs)."""
    if not has_cxx or kernels.best('cpu') != 'cpp':
        pytest.skip("no C++ compiler, or a CPU without AVX2: the C++ path falls back")
    return kernels.cpp_extension()


# ---------------------------------------------------------------- packing

def test_hf_layout_by_hand():
    # N = 5 -> R = 2: byte (r, c) holds rows r, r+2, r+4, (r+6: padding, q = 0 -> code 1)
    w_q = torch.tensor([[-1], [0], [1], [1], [-1], ], dtype=torch.int8)
    packed = kernels.pack_hf(w_q)
    assert packed.shape == (2, 1) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == 0 | 2 << 2 | 0 << 4 | 1 << 6  # rows 0, 2, 4, pad
    assert packed[1, 0].item() == 1 | 2 << 2 | 1 << 4 | 1 << 6  # rows 1, 3, pad, pad
    assert torch.equal(kernels.unpack_hf(packed, 5), w_q)


def test_hf_layout_matches_transformers_and_round_trips():
    w_q = ternary(12, 40)
    packed = kernels.pack_hf(w_q)
    assert torch.equal(kernels.unpack_hf(packed, 12), w_q)
    assert torch.equal(bitlinear.pack_hf(w_q), packed) and torch.equal(bitlinear.unpack_hf(packed, 12), w_q)
    hf = pytest.importorskip('transformers.integrations.bitnet')
    assert torch.equal(hf.pack_weights(w_q.clone()), packed)
    with torch.compiler.set_stance('force_eager'):
        assert torch.equal(hf.unpack_weights(packed, dtype=torch.float32), w_q.float())
    for N in (1, 5, 6, 7):  # rows that do not fill the last group of four
        assert torch.equal(kernels.unpack_hf(kernels.pack_hf(ternary(N, 9)), N), ternary(N, 9))


def test_kernel_layout_bit_positions():
    # column k of a row lives in byte 64 (k // 256) + k % 64, bits 2 ((k % 256) // 64)
    K = 300
    for k in (0, 1, 63, 64, 130, 255, 256, 299):
        w_q = torch.zeros(2, K, dtype=torch.int8)
        w_q[1, k] = 1
        packed = kernels.pack(w_q)
        assert packed.shape == (2, 512 // 4)  # K padded to 512
        expected = torch.full((2, 128), 0b01010101, dtype=torch.uint8)  # code 1 (q = 0) everywhere
        byte, shift = 64 * (k // 256) + k % 64, 2 * ((k % 256) // 64)
        expected[1, byte] += 1 << shift  # code 2 (q = 1)
        assert torch.equal(packed, expected), k
        assert torch.equal(kernels.unpack(packed, K), w_q)


def test_layouts_convert_into_each_other():
    for N, K in ((13, 300), (8, 256), (1, 7)):
        w_q = ternary(N, K)
        assert torch.equal(kernels.unpack(kernels.pack(w_q), K), w_q)
        assert torch.equal(kernels.pack(kernels.unpack_hf(kernels.pack_hf(w_q), N)), kernels.pack(w_q))
        assert torch.equal(kernels.pack_hf(kernels.unpack(kernels.pack(w_q), K)), kernels.pack_hf(w_q))


def test_quantize_is_bitlinear_activation_quant():
    x = torch.randn(6, 50) * torch.logspace(-6, 3, 6)[:, None]
    x[1] = 0
    x_q, s = kernels.quantize(x)
    ref_q, ref_s = activation_quant(x)
    assert x_q.dtype == torch.int8 and torch.equal(x_q.float(), ref_q) and torch.equal(s, ref_s)


# ---------------------------------------------------------------- the four paths

@pytest.mark.parametrize('M,N,K', SHAPES)
def test_reference_is_the_integer_matmul(M, N, K):
    w_q, x = ternary(N, K), int_inputs(M, K)
    y = kernels.ternary_linear(x, kernels.pack(w_q), torch.ones(1), impl='reference')
    assert torch.equal(y, (x.long() @ w_q.long().T).float())  # int64: an independent exact sum


@pytest.mark.parametrize('isa', [2, 1], ids=['avx512vnni', 'avx2'])
def test_cpp_is_bit_identical_to_reference(cpp, isa):
    if isa > cpp.simd():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    for M, N, K in SHAPES:
        w = kernels.pack(ternary(N, K))
        x = int_inputs(M, K)
        assert torch.equal(cpp.linear(x, w, torch.ones(1), isa), (x.long() @ ternary(N, K).long().T).float())
        x, gamma = torch.randn(M, K), torch.tensor([0.0371])
        x[0] = 0
        ref = kernels.ternary_linear(x, w, gamma, impl='reference')
        assert torch.equal(cpp.linear(x, w, gamma, isa), ref), (M, N, K)


@pytest.mark.parametrize('isa', [2, 1], ids=['avx512vnni', 'avx2'])
def test_per_row_gamma_and_int8_head(cpp, isa):
    """One gamma per row (q/k/v fused into one matrix) is each row's own gamma, bit for bit; int8
    rows (an LM head, kernels.pack_int8) times int16 activations, against int64 sums, bit for bit."""
    if isa > cpp.simd():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    for M, N, K in SHAPES:
        g = torch.Generator().manual_seed(M * N * K)
        x, gamma, w3 = torch.randn(M, K, generator=g), torch.rand(N, generator=g) + 0.01, kernels.pack(ternary(N, K))
        rows = [kernels.ternary_linear(x, w3[n:n + 1], gamma[n:n + 1], impl='reference') for n in range(N)]
        assert torch.equal(kernels.ternary_linear(x, w3, gamma, impl='reference'), torch.cat(rows, 1))
        assert torch.equal(cpp.linear(x, w3, gamma, isa), torch.cat(rows, 1))
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * torch.logspace(-3, 1, N)[:, None]
        w8, scale = kernels.pack_int8(w)
        assert w8.dtype == torch.int8 and w8.shape == (N, -(-K // 64) * 64) and w8.abs().max() == 127
        assert (w8[:, :K].float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding only
        x_q, s = kernels.quantize(x, 32767)
        assert x_q.dtype == torch.int16 and torch.equal(x_q.abs().amax(1), torch.full((M,), 32767, dtype=torch.int16))
        want = (x_q.long() @ w8[:, :K].long().T).float() * (scale / s)
        assert torch.equal(cpp.linear_w8(x, w8, scale, isa), want)
        assert torch.equal(kernels.ternary_linear(x, w8, scale, impl='reference'), want)
        # against fp activations: each x moves by at most absmax / (2 * 32767) when quantized
        W = w8[:, :K].double() * scale[:, None].double()
        fp = x.double() @ W.T
        bound = x.abs().amax(1, keepdim=True).double() / 65534 * W.abs().sum(1) + 1e-6 * fp.abs() + 1e-7
        assert ((want - fp).abs() <= bound).all()


def block_scaled(x, w_q, gamma):
    """The definition of block scales, computed apart: each block of 256 columns' exact product (int64)
    times its gamma in fp32, the blocks added first to last, then divided by s."""
    x_q, s = kernels.quantize(x)
    y = None
    for b in range(gamma.shape[1]):
        columns = slice(256 * b, 256 * (b + 1))
        part = (x_q[:, columns].long() @ w_q[:, columns].long().T).float() * gamma[:, b]
        y = part if y is None else y + part
    return y / s


@pytest.mark.parametrize('isa', [2, 1], ids=['avx512vnni', 'avx2'])
def test_block_gamma_is_each_blocks_product_added_in_order(cpp, isa):
    """One gamma per row and block of 256 columns (weight_scale='block'): the C++ kernel and the
    reference compute each block's integer product, scale it and add the blocks in order, bit for bit
    as computed apart, for decode and prefill tiles, four blocks in flight and a tail; with equal
    gammas, within fp32 rounding of one gamma."""
    if isa > cpp.simd():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    for M, N, K in ((1, 8, 256), (1, 13, 1280), (3, 7, 512), (5, 64, 1024), (17, 33, 768)):
        g = torch.Generator().manual_seed(M * N * K)
        x, w_q = torch.randn(M, K, generator=g) * 4, ternary(N, K)
        x[0, :256] = 0  # a token's first block all zeros
        gamma = torch.rand(N, K // 256, generator=g) + 0.01
        want = block_scaled(x, w_q, gamma)
        w = kernels.pack(w_q)
        assert torch.equal(kernels.ternary_linear(x, w, gamma, impl='reference'), want), (M, N, K)
        assert torch.equal(cpp.linear(x, w, gamma, isa), want), (M, N, K)
        equal = torch.full((N, K // 256), 0.37)
        one = cpp.linear(x, w, torch.tensor([0.37]), isa)
        assert (cpp.linear(x, w, equal, isa) - one).abs().max() <= 1e-6 * one.abs().max()
    with pytest.raises(ValueError, match="2 gammas per row for K=768; block scales need one per 256"):
        kernels.ternary_linear(torch.randn(2, 768), kernels.pack(ternary(4, 768)), torch.ones(4, 2))


def test_dispatch_uses_cpp_with_bf16_and_leading_dims(cpp):
    w_q = ternary(24, 200)
    x = torch.randn(2, 3, 200).bfloat16()
    y = kernels.ternary_linear(x, kernels.pack(w_q), torch.tensor([0.5]))
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    ref = kernels.ternary_linear(x, kernels.pack(w_q), torch.tensor([0.5]), impl='reference')
    assert torch.equal(y, ref)


def test_ops_have_fake_implementations(cpp):
    w, x, gamma = kernels.pack(ternary(13, 300)), torch.randn(3, 300), torch.ones(1)
    for name in ('reference', 'cpp'):
        result = torch.library.opcheck(kernels.OPS[name], (x, w, gamma))
        assert set(result.values()) == {'SUCCESS'}, result
    y = kernels.OPS['cuda'](x.to('meta'), w.to('meta'), gamma.to('meta'))  # shapes only, no GPU needed
    assert y.shape == (3, 13) and y.dtype == torch.float32


@pytest.mark.slow
def test_compile_path_is_bit_identical_and_composes_with_torch_compile(cpp):
    for M, N, K in ((1, 13, 100), (5, 64, 1000)):
        w, x = kernels.pack(ternary(N, K)), int_inputs(M, K)
        assert torch.equal(kernels.ternary_linear(x, w, torch.ones(1), impl='compile'),
                           (x.long() @ ternary(N, K).long().T).float())
        x = torch.randn(M, K)
        assert torch.equal(kernels.ternary_linear(x, w, torch.tensor([0.3]), impl='compile'),
                           kernels.ternary_linear(x, w, torch.tensor([0.3]), impl='reference'))
    # a gamma per row and block of 256 columns
    x, w_q, gamma = torch.randn(3, 768), ternary(24, 768), torch.rand(24, 3) + 0.01
    assert torch.equal(kernels.ternary_linear(x, kernels.pack(w_q), gamma, impl='compile'), block_scaled(x, w_q, gamma))
    # the C++ op inside a compiled graph: its fake implementation lets the whole graph trace
    layer = freeze(torch.nn.Sequential(BitLinear(64, 40)))[0]
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_is_bit_identical_to_reference():
    kernels.choose.cache_clear()
    assert kernels.best('cuda') == 'cuda'
    # M > 16: the int8 tensor-core path; then GEMVs over several shared-memory tiles of K
    for M, N, K in SHAPES + [(32, 64, 512), (40, 24, 256), (16, 40, 4100), (8, 70, 33000)]:
        w_q = ternary(N, K)
        w, x = kernels.pack(w_q).cuda(), int_inputs(M, K).cuda()
        y = kernels.ternary_linear(x, w, torch.ones(1, device='cuda'), impl='cuda')
        assert torch.equal(y.cpu(), (x.cpu().long() @ w_q.long().T).float()), (M, N, K)
        x, gamma = torch.randn(M, K, device='cuda'), torch.tensor([0.2], device='cuda')
        assert torch.equal(kernels.ternary_linear(x, w, gamma, impl='cuda'),
                           kernels.ternary_linear(x, w, gamma, impl='reference'))


@pytest.mark.skipif(shutil.which('nvcc') is None, reason="needs nvcc (the CUDA toolkit), not a GPU")
def test_cuda_kernel_compiles_with_nvcc(tmp_path):
    # a CPU build of torch has no CUDA headers, so compile the kernel part alone, as plain CUDA,
    # for the A100 and the H100/H200
    (tmp_path / 'gemv.cu').write_text(kernels.GEMV_CU)
    arches = [f'-gencode=arch=compute_{a},code=sm_{a}' for a in (80, 90)]
    r = subprocess.run(['nvcc', '-c', '-O3', *arches, 'gemv.cu', '-o', 'gemv.o'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    binary = (tmp_path / 'gemv.o').read_bytes()
    for tokens in (1, 2, 4, 8, 16):  # every GEMV gemv_for picks
        assert f'ternary_gemvILi{tokens}EE'.encode() in binary


def test_unpacked_copy_is_made_once_per_weight_and_dropped_with_it():
    before = kernels.unpacked_bytes()
    w_q = ternary(13, 300)
    w = kernels.pack(w_q)
    w8 = kernels.unpacked(w)
    assert w8.dtype == torch.int8 and w8.shape == (16, 512)  # rows to a multiple of 8, K to 256
    assert torch.equal(w8[:13, :300], w_q.to(torch.int8)) and not w8[13:].any() and not w8[:, 300:].any()
    assert kernels.unpacked(w) is w8  # kept, not unpacked again
    assert kernels.unpacked_bytes() == before + 16 * 512
    w.copy_(kernels.pack(-w_q))  # changed in place: a new copy
    assert torch.equal(kernels.unpacked(w)[:13, :300], -w_q.to(torch.int8))
    del w, w8
    gc.collect()
    assert kernels.unpacked_bytes() == before


def test_dispatch_falls_back_once_without_a_compiler(monkeypatch):
    monkeypatch.setenv('CXX', '/no/such/c++')  # a compiler that is not there
    kernels.choose.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler found.*'reference'"):
            assert kernels.best('cpu') == 'reference'
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # the notice is given once
            assert kernels.best('cpu') == 'reference'
    finally:
        kernels.choose.cache_clear()


def test_mismatched_k_is_a_clear_error():
    with pytest.raises(ValueError, match='pack W_q of shape'):
        kernels.ternary_linear(torch.randn(2, 600), kernels.pack(ternary(4, 300)), torch.ones(1))


# ---------------------------------------------------------------- PackedBitLinear and freeze

def test_freeze_keeps_only_2bit_weights_and_matches_bitlinear(cpp):
    torch.manual_seed(0)
    layer = BitLinear(300, 13, bias=True)
    x = torch.randn(2, 5, 300)
    with torch.no_grad():
        ref = layer(x)
        w_q, gamma = weight_quant(layer.weight)
        net = freeze(torch.nn.Sequential(layer))
        y = net(x)
    packed = net[0]
    assert isinstance(packed, PackedBitLinear) and packed.weight.dtype == torch.uint8
    assert packed.weight.nbytes == 13 * 512 // 4 and [n for n, _ in packed.named_parameters()] == ['bias']
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)  # fake-quant fp vs exact integer sums
    sd = packed.state_dict()  # transformers' offline format, whatever layout sits in memory
    assert torch.equal(sd['weight'], kernels.pack_hf(w_q)) and torch.equal(sd['weight_scale'], gamma.view(1))
    assert torch.allclose(sd['bias'] * gamma, layer.bias)  # stored divided by gamma, as transformers reads it
    again = PackedBitLinear(torch.zeros(13, 300), torch.ones(()), torch.nn.Parameter(torch.zeros(13)))
    again.load_state_dict(sd)
    with torch.no_grad():
        assert torch.allclose(again(x), y, rtol=0, atol=1e-6)  # the bias's round trip through / gamma rounds


def test_bitlinear_alone_falls_back_to_pure_torch_with_the_same_numbers(tmp_path, cpp):
    """bitlinear.py copied alone packs in the HF layout and computes in pure torch: the same outputs, bit
    for bit, and the same state dict, with one gamma per matrix and with block scales."""
    shutil.copy(os.path.join(ROOT, 'bitlinear.py'), tmp_path)
    script = ("import torch, bitlinear\n"
              "assert bitlinear.kernels is None\n"
              "out = {}\n"
              "for scales, K in (('matrix', 300), ('block', 512)):\n"
              "    torch.manual_seed(0)\n"
              "    layer = bitlinear.BitLinear(K, 13)\n"
              "    layer.scales = scales\n"
              "    net = bitlinear.freeze(torch.nn.Sequential(layer))\n"
              "    out[scales] = (net(torch.randn(3, K)).detach(), net[0].state_dict())\n"
              "torch.save(out, 'out.pt')\n")
    r = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, 'PYTHONPATH': ''})
    assert r.returncode == 0, r.stderr
    alone = torch.load(tmp_path / 'out.pt')
    for scales, K in (('matrix', 300), ('block', 512)):
        y_alone, sd_alone = alone[scales]
        torch.manual_seed(0)
        layer = BitLinear(K, 13)
        layer.scales = scales
        net = freeze(torch.nn.Sequential(layer))
        with torch.no_grad():
            assert torch.equal(net(torch.randn(3, K)), y_alone), scales  # fp32 sums of integers are exact too
        assert all(torch.equal(v, sd_alone[k]) for k, v in net[0].state_dict().items()), scales


# ---------------------------------------------------------------- the packed model and its export

def tiny_ternary(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=90, n_layer=2, n_embd=64, n_head=8, n_kv_head=2, intermediate_size=80, bitnet=True,
               act='relu2', tie_embeddings=False)
    model = Transformer(ModelConfig(**{**cfg, **kw})).eval()
    with torch.no_grad():  # random norm gains catch a norm applied in the wrong place
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.uniform_(0.5, 1.5)
    return model


def tensor_bytes(path):
    return sum(t.nbytes for t in load_file(os.path.join(path, 'model.safetensors')).values())


def test_packed_export_is_smaller_and_loads_back_exactly(tmp_path, cpp):
    model = tiny_ternary()
    idx = torch.randint(90, (2, 11), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path / 'online')
    with torch.no_grad():
        ref = model(idx)
        frozen = model.freeze()(idx)
    model.save_pretrained(tmp_path / 'offline')
    cfg = json.load(open(tmp_path / 'offline' / 'config.json'))
    assert cfg['quantization_config']['quantization_mode'] == 'offline'
    # every ternary matrix (out, in) shrinks from 4 * out * in bytes to ceil(out/4) * in, plus a 4-byte gamma
    shapes = [(64, 64)] * 2 + [(16, 64)] * 2 + [(80, 64)] * 2 + [(64, 80)]
    saved = sum(4 * N * K - (-(-N // 4) * K + 4) for N, K in shapes) * 2
    assert tensor_bytes(tmp_path / 'online') - tensor_bytes(tmp_path / 'offline') == saved
    assert torch.allclose(frozen, ref, atol=1e-4)
    loaded = Transformer.from_pretrained(str(tmp_path / 'offline')).eval()
    assert loaded.config.packed and isinstance(loaded.layers[0].mlp.up_proj, PackedBitLinear)
    with torch.no_grad():
        assert torch.equal(loaded(idx), frozen)


def hf_logits(path, idx):
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('accelerate')
    # transformers wraps its BitNet quantizers in torch.compile; eager gives the same numbers faster
    with torch.compiler.set_stance('force_eager'), torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        return type(ref.model.layers[0].mlp.up_proj).__name__, ref(idx).logits


def biased(model):
    """Qwen-style attention biases, random, so that where the bias is added (before or after gamma) shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('bias'):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize('bias', [False, True])
def test_transformers_loads_the_packed_export_with_the_same_logits(tmp_path, cpp, bias):
    model = biased(tiny_ternary(tie_embeddings=True, attention_bias=bias)).freeze()
    model.save_pretrained(tmp_path)
    idx = torch.randint(90, (2, 11), generator=torch.Generator().manual_seed(1))
    name, ref = hf_logits(tmp_path, idx)
    assert name == 'AutoBitLinear'
    loaded = Transformer.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert (model(idx) - ref).abs().max().item() <= 1e-4
        assert (loaded(idx) - model(idx)).abs().max().item() <= 1e-5  # import agrees too


@pytest.mark.parametrize('bias', [False, True])
def test_older_bitlinear_class_with_inverse_scale_loads(tmp_path, cpp, bias):
    # transformers' older BitLinear class stores 1/gamma, divides by it, and adds the bias after
    model = biased(tiny_ternary(attention_bias=bias)).freeze()
    model.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / 'config.json'))
    cfg['quantization_config']['linear_class'] = 'bitlinear'
    json.dump(cfg, open(tmp_path / 'config.json', 'w'))
    sd = load_file(tmp_path / 'model.safetensors')
    sd = {k: v * sd[k.removesuffix('bias') + 'weight_scale'] if k.endswith('proj.bias') else v for k, v in sd.items()}
    save_file({k: 1 / v if k.endswith('weight_scale') else v for k, v in sd.items()}, tmp_path / 'model.safetensors',
              metadata={'format': 'pt'})
    idx = torch.randint(90, (2, 11), generator=torch.Generator().manual_seed(1))
    name, ref = hf_logits(tmp_path, idx)
    assert name == 'BitLinear'
    ours = Transformer.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert (ours(idx) - ref).abs().max().item() <= 1e-4
        assert (ours(idx) - model(idx)).abs().max().item() <= 1e-5


def test_freezing_needs_a_ternary_model():
    with pytest.raises(ValueError, match='only a ternary model can be frozen'):
        Transformer(ModelConfig(n_layer=1, n_embd=32, n_head=2, n_kv_head=2, intermediate_size=40)).freeze()


@pytest.mark.slow
def test_sample_runs_ternary_checkpoints_packed(tmp_path, cpp):
    tiny_ternary(vocab_size=320, max_seq_len=64).save_pretrained(tmp_path)
    mib = {}
    for flag, kind in (('--packed=True', 'packed ternary'), ('--packed=False', 'ternary (fake-quantized)')):
        r = subprocess.run([sys.executable, 'sample.py', f'--ckpt={tmp_path}', '--num_tokens=12', '--prompt=Hi',
                            '--tokenizer=bytes', flag], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        last = r.stdout.strip().splitlines()[-1]
        assert f': {kind}, weights' in last and 'tokens/s' in last, last
        mib[kind] = float(last.split('weights ')[1].split(' MiB')[0])
    sd = load_file(tmp_path / 'model.safetensors')
    fp_mib = sum(t.nbytes for t in sd.values()) / 2**20
    # packed: each ternary matrix 2 bits per weight (K padded to 256) + gamma, instead of fp32; plus the
    # int8 copy of the (tied) head that fuse() makes for decode, K padded to 64, and a scale per row
    mats = [v.shape for k, v in sd.items() if k.endswith('proj.weight')]
    V, C = sd['model.embed_tokens.weight'].shape
    packed = fp_mib * 2**20 + sum(N * -(-K // 256) * 64 + 4 - 4 * N * K for N, K in mats) + V * (-(-C // 64) * 64 + 4)
    assert abs(mib['ternary (fake-quantized)'] - fp_mib) < 0.051 and abs(mib['packed ternary'] - packed / 2**20) < 0.051
