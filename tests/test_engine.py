"""engine.py: generation with a KV cache against full forwards, the fused decode model, the CUDA-graph decoder;
sample.py's judge."""
import copy
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import GraphDecoder, fuse, generate
from model import ModelConfig, Transformer
from test_data import ROOT, train_hf_tokenizer
from test_model import tokens
from tokenizer import get_tokenizer


def test_generate_with_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=40,
                                    bitnet=True)).eval()
    idx = tokens(50, B=2, T=5)
    out = generate(model, idx, 12, temperature=0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], idx)
    with torch.no_grad():  # greedy decoding re-derived without a cache, one full forward per token
        seq = idx
        for _ in range(12):
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize('scales,width,hidden', [('matrix', 64, 96), ('block', 256, 512)])
def test_fuse_changes_only_the_head_and_saves_the_same_checkpoint(tmp_path, scales, width, hidden):
    """engine.fuse: fused q/k/v and gate/up give every block's output bit for bit (each row keeps
    its matrix's gamma, or its row's block gammas); the head becomes int8 rows, checked against its
    definition computed here; state_dict (and so save_pretrained) is what it was; generation with
    the cache matches."""
    from kernels import quantize
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_embd=width, n_head=4, n_kv_head=2, intermediate_size=hidden,
                      bitnet=True, weight_scale=scales)
    model = Transformer(cfg).eval().freeze()
    idx = tokens(300, B=2, T=9)
    with torch.no_grad():
        ref = {'hidden': []}
        want_logits = model(idx, feats=ref)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fuse(model)
        got = {'hidden': []}
        logits = model(idx, feats=got)
    from engine import FusedAttention, FusedMLP, Int8Head
    assert all(type(b.self_attn) is FusedAttention and type(b.mlp) is FusedMLP for b in model.layers)
    assert type(model.lm_head) is Int8Head and model.lm_head.weight is model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(ref['hidden'], got['hidden']))
    h = model.norm(got['hidden'][-1]).reshape(-1, width)
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
    assert torch.equal(generate(model, idx, 6, temperature=0), seq)


DECODER_MODELS = {
    'GQA': dict(n_kv_head=2),
    'Mistral, window 6': dict(n_kv_head=2, sliding_window=6, family='mistral'),  # a window < the 22 tokens
    'Qwen3, q/k norm': dict(qk_norm=True, family='qwen3'),
    'packed and fused': dict(bitnet=True),
}


@pytest.mark.parametrize('kind', DECODER_MODELS)
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_graph_decoder_continues_as_generate(kind, device):
    """GraphDecoder's fixed-shape step (the whole cache, masked past a position held in a tensor)
    picks the tokens generate picks, for two prompts in a row through the same buffers (the first
    one's keys stay in the cache, masked); on CUDA from a replayed graph."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=120, n_layer=2, n_embd=64, n_head=4, intermediate_size=96, max_seq_len=40,
                      **DECODER_MODELS[kind])
    model = Transformer(cfg).eval().to(device)
    if cfg.bitnet:
        model = fuse(model.freeze())
    decoder = GraphDecoder(model, batch=2, max_len=24, vocab=100)
    for T, new in ((9, 12), (5, 17)):
        idx = tokens(100, B=2, T=T).to(device)
        assert torch.equal(decoder(idx, new), generate(model, idx, new, temperature=0, vocab=100))
    assert (decoder.graph is not None) == (device == 'cuda')
    with pytest.raises(ValueError, match='exceed max_len=24'):
        decoder(idx, 20)
    # one fixed-shape step against the sliced one, over a cache of random keys and values: those past
    # the position (and, in a window, before it) must get no weight
    cache = [torch.randn(2, 2, cfg.n_kv_head, 24, cfg.head_dim, device=device) for _ in range(2)]
    fixed = [c.clone() for c in cache]
    x = tokens(100, B=2, T=1).to(device)
    decoder.cache, decoder.token = fixed, x.clone()
    decoder.pos.fill_(9)
    with torch.no_grad():
        want, got = model(x, cache, 9), decoder.forward()
    assert (got - want).abs().max() < 1e-5
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(cache, fixed))  # this step's keys written at 9
    assert torch.equal(cache[0], fixed[0])  # the first block's exactly: its input is the same


ONE_CALL_MODELS = {
    'GQA, SubLN, a gamma per matrix': dict(n_kv_head=2, subln=True),
    'a gamma per row, ReLU^2': dict(weight_scale='row', act='relu2', subln=True),
    'a gamma per block, no SubLN': dict(n_embd=256, intermediate_size=512, weight_scale='block'),
    'Mistral, window 6': dict(n_kv_head=2, sliding_window=6, family='mistral', subln=True),
}


def eager_twin(fused):
    """The same fused modules, stepped op by op by Transformer's forward."""
    eager = copy.deepcopy(fused)
    eager.__class__ = Transformer
    return eager


@pytest.mark.parametrize('kind', ONE_CALL_MODELS)
def test_the_one_call_decode_step_is_the_eager_step(kind):
    """engine.fuse's FusedTransformer runs a one-token step with a cache as one C++ call
    (kernels.decode_step, no module called): the eager step's logits to rounding and the same keys
    and values written at the position, for a batch whose second row is left-padded (masked keys)
    and through a sliding window; greedy generate and batched rollouts pick the same tokens."""
    from engine import FusedTransformer, rollout
    from kernels import best
    if best('cpu') != 'cpp':
        pytest.skip("no C++ compiler, or a CPU without AVX2: decode steps run eagerly")
    torch.manual_seed(0)
    shape = dict(vocab_size=300, n_layer=3, n_embd=64, n_head=4, intermediate_size=96, max_seq_len=48)
    cfg = ModelConfig(**shape | ONE_CALL_MODELS[kind], bitnet=True)
    fused = fuse(Transformer(cfg).eval().freeze())
    eager = eager_twin(fused)
    assert type(fused) is FusedTransformer
    calls = []
    fused.layers[0].register_forward_hook(lambda *args: calls.append(1))
    cache = [torch.randn(2, 2, cfg.n_kv_head, 24, cfg.head_dim) for _ in range(cfg.n_layer)]
    theirs = [c.clone() for c in cache]
    valid = torch.ones(2, 24, dtype=torch.bool)
    valid[1, :17] = False  # row 1 is left-padded to position 16 (inside Mistral's window at 20)
    x = tokens(300, B=2, T=1)
    with torch.no_grad():
        got = fused(x, cache, 20, valid=valid[:, :21])
        want = eager(x, theirs, 20, valid=valid[:, :21])
        unmasked = fused(x, [c.clone() for c in cache], 20)
    assert not calls and got.shape == want.shape == (2, 1, 300)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert torch.equal(unmasked[0], got[0]) and not torch.equal(unmasked[1], got[1])
    for a, b in zip(cache, theirs):
        assert torch.equal(a[..., :20, :], b[..., :20, :]) and torch.equal(a[..., 21:, :], b[..., 21:, :])
        assert (a[..., 20, :] - b[..., 20, :]).abs().max() < 1e-4 * b.abs().max()
    idx = tokens(300, B=2, T=7)
    assert torch.equal(generate(fused, idx, 16, temperature=0), generate(eager, idx, 16, temperature=0))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    ours, theirs = rollout(fused, prompts, 12, temperature=0), rollout(eager, prompts, 12, temperature=0)
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], theirs[:3]))
    # log-probabilities to rounding: a norm's last bit (torch sums x^2 in another order) can move an
    # activation's int8 code by one, a step of 1/127 of the row's absmax
    assert (ours[3] - theirs[3]).abs().max() < 0.05


def test_the_one_call_step_times_its_parts_and_decodes_alike():
    """bench.py's profile of a one-call step: with step_times, kernels.decode_step adds each
    part's seconds (head, projections, attention, the rest), together at most the generate's
    wall time; the tokens are the untimed step's."""
    import time
    from engine import FusedTransformer
    from kernels import best
    if best('cpu') != 'cpp':
        pytest.skip("no C++ compiler, or a CPU without AVX2: decode steps run eagerly")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                      intermediate_size=96, bitnet=True)
    fused = fuse(Transformer(cfg).eval().freeze())
    assert type(fused) is FusedTransformer
    idx = tokens(300, B=1, T=5)
    want = generate(fused, idx, 8, temperature=0)
    fused.step_times = torch.zeros(4, dtype=torch.float64)
    t0 = time.perf_counter()
    got = generate(fused, idx, 8, temperature=0)
    wall = time.perf_counter() - t0
    assert torch.equal(got, want)
    assert (fused.step_times > 0).all() and fused.step_times.sum() < wall


@pytest.mark.parametrize('kind', ['q/k norms', 'biases', 'mixture of experts', 'SubLN at half strength'])
def test_a_model_the_one_call_step_cannot_run_decodes_eagerly(kind):
    """What kernels.decode_step does not compute (Qwen3's q/k norms, biases, experts, a SubLN blending
    in its input) leaves fuse's model a Transformer, whose cached decode is its full forwards'."""
    from bitlinear import set_lambda
    torch.manual_seed(0)
    extra = {'q/k norms': dict(qk_norm=True, family='qwen3'), 'biases': dict(attention_bias=True),
             'mixture of experts': dict(n_experts=4, top_k=2, moe_intermediate_size=16),
             'SubLN at half strength': dict(subln=True)}[kind]
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4, intermediate_size=96, bitnet=True, **extra)
    packed = Transformer(cfg).eval().freeze()
    if kind == 'SubLN at half strength':
        set_lambda(packed, 0.5)
    fused = fuse(packed)
    assert type(fused) is Transformer
    seq = idx = tokens(300, B=1, T=5)
    with torch.no_grad():  # greedy decoding without a cache, one full forward per token
        for _ in range(6):
            seq = torch.cat((seq, fused(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(generate(fused, idx, 6, temperature=0), seq)


def test_profile_token_times_every_part_and_puts_everything_back():
    """Packed and fused: every part timed, the parts adding up to the token, and the model
    left as it was (no hook, the same modules) and decoding alike."""
    from engine import profile_token
    torch.manual_seed(0)
    packed = Transformer(ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4,
                                     n_kv_head=2, intermediate_size=96,
                                     bitnet=True)).eval().freeze()
    idx = tokens(300, B=1, T=5)
    for model in (packed, fuse(copy.deepcopy(packed))):
        kinds = [(name, type(m)) for name, m in model.named_modules()]
        want = generate(model, idx, 4, temperature=0)
        parts = profile_token(model, idx, 4)
        assert set(parts) == {'head', 'projections', 'attention', 'rest', 'total'}
        assert all(parts[k] > 0 for k in ('head', 'projections', 'attention', 'total'))
        assert abs(sum(v for k, v in parts.items() if k != 'total') - parts['total']) < 1e-9
        assert [(name, type(m)) for name, m in model.named_modules()] == kinds
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert torch.equal(generate(model, idx, 4, temperature=0), want)

def test_sample_scores_its_new_tokens_by_a_judge(tmp_path):
    """sample.py --judge=DIR prints the judge's mean nats per token on exactly the tokens sampled after the
    prompt (recomputed here from the same greedy continuation), for each line of --prompts as for --prompt;
    a judge with another tokenizer, or an empty prompt file, is refused in one line before any sampling."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                      max_seq_len=64)
    model, judge = Transformer(cfg).eval(), Transformer(cfg).eval()
    model.save_pretrained(str(tmp_path / 'model'))
    judge.save_pretrained(str(tmp_path / 'judge'))
    cmd = [sys.executable, 'sample.py', f'--ckpt={tmp_path / "model"}', '--prompt=Hi there', '--num_tokens=10',
           '--temperature=0', f'--judge={tmp_path / "judge"}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    found = re.fullmatch(r'--- judge .*: (\d+\.\d+) nats/token on the 10 new tokens', r.stdout.strip().splitlines()[-1])
    enc = get_tokenizer('bytes')
    idx = torch.tensor([enc.encode_ordinary('Hi there')])
    out = generate(model, idx, 10, temperature=0, vocab=enc.n_vocab)
    with torch.no_grad():
        nats = F.cross_entropy(judge(out[:, :-1])[0, idx.size(1) - 1:], out[0, idx.size(1):]).item()
        own = F.cross_entropy(model(out[:, :-1])[0, idx.size(1) - 1:], out[0, idx.size(1):]).item()
    assert found and abs(float(found[1]) - nats) < 1e-3 and abs(own - nats) > 0.01
    # --prompts: one prompt a line, each as if it were sampled alone
    (tmp_path / 'prompts.txt').write_text('Hi there\n\nSomething else\n')
    r = subprocess.run(cmd[:3] + [f'--prompts={tmp_path / "prompts.txt"}'] + cmd[4:], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    judged = [line for line in r.stdout.splitlines() if line.startswith('--- judge')]
    assert len(judged) == 2 and judged[0] == found[0]
    (tmp_path / 'prompts.txt').write_text('\n')
    r = subprocess.run(cmd[:3] + [f'--prompts={tmp_path / "prompts.txt"}'] + cmd[4:], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().endswith('holds no prompt; write one a line')
    train_hf_tokenizer('gpt2', str(tmp_path / 'judge'))  # the judge now reads another tokenizer
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == ''
    assert r.stderr.strip().endswith("has another tokenizer than the model; it can only score text in the "
                                      "same tokens")


def test_a_temperature_however_small_samples_the_greedy_tokens():
    """temperature=1e-300 (0 in float32) once ended sample.py in a RuntimeError (0 / 0 in the
    softmax): any temperature above 0 samples, and one that small gives the greedy tokens."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                                    intermediate_size=96)).eval()
    idx = tokens(300, B=2, T=5)
    greedy = generate(model, idx, 8, temperature=0)
    for t in (1e-300, 1e-45, 1e-30):
        assert torch.equal(generate(model, idx, 8, temperature=t), greedy), t
