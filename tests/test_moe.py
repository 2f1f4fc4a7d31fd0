"""The mixture of experts (moe.py, model.py) and its router losses (objectives.py): logits equal
transformers' Qwen2-MoE both ways, the sparse dispatch equals a dense reference that runs every
expert, each router loss equals an independent computation (values and hand-derived gradients),
the ternary MoE round-trips through our own format and packs, and sparse upcycling keeps the
dense model's function."""
import json
import math

import pytest
import torch

from bitlinear import SubLN, calibrate_subln
from engine import fuse, generate
from gguf_export import unsupported
from model import MLP, ModelConfig, Transformer
from moe import MoE
from objectives import ObjectiveManager, RouterLoss, router_losses

transformers = pytest.importorskip('transformers')


def config(**kw):
    base = dict(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48,
                max_seq_len=64, n_experts=4, top_k=2, moe_intermediate_size=16)
    return ModelConfig(**base | kw)


def tokens(B=2, T=12):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('shared, norm, tie', [(0, True, True), (1, False, False), (2, True, False)])
def test_our_moe_opens_in_transformers_as_qwen2_moe_with_the_same_logits(tmp_path, shared, norm, tie):
    torch.manual_seed(0)
    model = Transformer(config(n_shared_experts=shared, norm_topk_prob=norm, tie_embeddings=tie))
    model.save_pretrained(tmp_path)
    hf = json.load(open(tmp_path / 'config.json'))
    assert hf['model_type'] == 'qwen2_moe' and hf['shared_expert_intermediate_size'] == 16 * shared
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(theirs).__name__ == 'Qwen2MoeForCausalLM'
    with torch.no_grad():
        assert (theirs(tokens()).logits - model(tokens())).abs().max() < 1e-4
    back = Transformer.from_pretrained(str(tmp_path))  # and back, the zero-wide shared expert dropped
    assert back.config.n_shared_experts == shared and back.config.norm_topk_prob == norm
    with torch.no_grad():
        assert torch.equal(back(tokens()), model(tokens()))


def test_a_transformers_qwen2_moe_loads_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                      num_experts_per_tok=3, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=32, qkv_bias=False, rope_theta=5e4)
    theirs = transformers.Qwen2MoeForCausalLM(cfg)  # norm_topk_prob False: its default
    for p in theirs.parameters():  # its init leaves the router at zero: every expert would tie
        torch.nn.init.normal_(p, std=0.2)
    theirs.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(str(tmp_path))
    assert (ours.config.n_experts, ours.config.top_k, ours.config.n_shared_experts) == (6, 3, 2)
    assert not ours.config.norm_topk_prob
    with torch.no_grad():
        assert (theirs(tokens()).logits - ours(tokens())).abs().max() < 1e-4


def test_what_our_moe_lacks_is_refused_in_one_line(tmp_path):
    Transformer(config()).save_pretrained(tmp_path)
    hf = json.load(open(tmp_path / 'config.json'))
    for bad, what in (({'use_sliding_window': True}, 'use_sliding_window'), ({'mlp_only_layers': [0]}, 'dense layers'),
                      ({'shared_expert_intermediate_size': 24}, 'no multiple'), ({'model_type': 'olmoe'}, 'olmoe')):
        json.dump(hf | bad, open(tmp_path / 'config.json', 'w'))
        with pytest.raises(ValueError, match=what):
            Transformer.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match='top_k=5 must be between 1 and n_experts=4'):
        config(top_k=5)
    assert unsupported(config()) == ['a mixture of experts']


def dense_reference(moe, x):
    """Every expert on every token, its output masked by the routing weights."""
    x2 = x.reshape(-1, x.shape[-1])
    weights, chosen = moe.route(moe.gate(x2))
    full = torch.zeros(x2.shape[0], len(moe.experts)).scatter(1, chosen, weights)  # (N, E)
    y = sum(full[:, e:e + 1] * expert(x2) for e, expert in enumerate(moe.experts))
    if moe.shared_expert is not None:
        y = y + torch.sigmoid(moe.shared_expert_gate(x2)) * moe.shared_expert(x2)
    return y.view(x.shape)


@pytest.mark.parametrize('bitnet', [False, True])
@pytest.mark.parametrize('top_k, shared', [(1, 0), (2, 1), (4, 0)])
def test_sparse_dispatch_equals_running_every_expert(bitnet, top_k, shared):
    torch.manual_seed(0)
    model = Transformer(config(top_k=top_k, n_shared_experts=shared, bitnet=bitnet))
    moe = model.layers[0].mlp
    x = torch.randn(3, 10, 32, requires_grad=True)
    rows = []
    hooks = [e.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for e in moe.experts]
    y = moe(x)
    for h in hooks:
        h.remove()
    assert sum(rows) == 30 * top_k and len(rows) == 4  # each expert once, on its own tokens only
    y_ref = dense_reference(moe, x)
    assert (y - y_ref).abs().max() < 1e-5
    g = torch.randn_like(y)
    params = [x, *moe.parameters()]
    ours = torch.autograd.grad(y, params, g)
    ref = torch.autograd.grad(y_ref, params, g)
    for a, b in zip(ours, ref):
        assert (a - b).abs().max() < 1e-5


def test_an_expert_without_tokens_still_gets_a_zero_gradient_and_keeps_its_subln_gain():
    """DDP and FSDP expect a gradient for every parameter on every rank."""
    torch.manual_seed(0)
    model = Transformer(config(bitnet=True))
    moe = model.layers[0].mlp
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0] = moe.gate.weight[1, 0] = 50.0  # every token to experts 0 and 1
    x = torch.randn(2, 5, 32)
    x[..., 0] = 1.0
    moe(x).sum().backward()
    idle = moe.experts[3].down_proj.weight.grad
    assert idle is not None and idle.abs().max() == 0
    assert moe.experts[0].down_proj.weight.grad.abs().max() > 0
    calibrate_subln(moe, [x])  # the layer alone, on the same routing
    idle, busy = ([m.weight for m in moe.experts[i].modules() if isinstance(m, SubLN)] for i in (3, 0))
    assert idle and all(torch.equal(g, torch.ones_like(g)) for g in idle)
    assert not torch.equal(busy[0], torch.ones_like(busy[0]))


def by_hand(z, k):
    """The router terms of logits z (N, E) with Python floats."""
    N, E = len(z), len(z[0])
    p = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in z]
    counts = [0] * E
    for row in p:
        for i in sorted(range(E), key=lambda i: -row[i])[:k]:
            counts[i] += 1
    f = [c / (N * k) for c in counts]
    P = [sum(row[i] for row in p) / N for i in range(E)]
    mean_sq = [sum(row[i] ** 2 for row in p) / N for i in range(E)]
    lse = [math.log(sum(math.exp(v) for v in row)) for row in z]
    return dict(load_balance=E * sum(a * b for a, b in zip(f, P)),
                router_aux=sum((a - 1 / E) ** 2 for a in mean_sq) / E,
                z_loss=sum(v * v for v in lse) / N,
                router_entropy=-sum(v * math.log(v) for row in p for v in row) / N,
                expert_load=max(counts) / (sum(counts) / E)), p, f, mean_sq, lse


def test_each_router_loss_and_its_gradient_by_hand():
    torch.manual_seed(0)
    z = torch.randn(7, 5) * 2
    k, N, E = 2, 7, 5
    want, p, f, mean_sq, lse = by_hand(z.tolist(), k)
    got = router_losses(z, k)
    for name, value in want.items():
        assert abs(got[name].item() - value) < 1e-5 * max(1, abs(value)), name
    p, f, a = torch.tensor(p, dtype=torch.float64), torch.tensor(f, dtype=torch.float64), torch.tensor(mean_sq)
    # d/dz_nj, derived by hand: softmax's Jacobian is p_ni (delta_ij - p_nj)
    grads = {'load_balance': E / N * p * (f - (p * f).sum(1, keepdim=True)),
             'z_loss': 2 / N * torch.tensor(lse, dtype=torch.float64)[:, None] * p,
             'router_aux': 4 / (E * N) * ((a - 1 / E) * p ** 2 - p * ((a - 1 / E) * p ** 2).sum(1, keepdim=True))}
    for name, grad in grads.items():
        z_ = z.clone().requires_grad_()
        router_losses(z_, k)[name].backward()
        assert (z_.grad.double() - grad).abs().max() < 1e-6, name


def test_load_balance_is_transformers_load_balancing_loss_over_top_k():
    """transformers' f_i counts assignments per token (they sum to top_k), ours per assignment
    (they sum to 1): its loss is top_k times ours, layer by layer."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func
    torch.manual_seed(0)
    layers = [torch.randn(40, 6) for _ in range(3)]
    for k in (1, 2, 3):
        for z in layers:
            theirs = load_balancing_loss_func((z,), 6, k)
            assert abs(theirs.item() - k * router_losses(z, k)['load_balance'].item()) < 1e-5


def test_the_router_objective_weighs_its_terms_and_averages_over_layers():
    torch.manual_seed(0)
    layers = [torch.randn(20, 4), torch.randn(20, 4) * 3]
    objective = RouterLoss(top_k=2, load_balance=0.5, z_loss=0.25, aux=2.0)
    loss = objective.loss({}, {'router': layers}, None)
    terms = [router_losses(z, 2) for z in layers]
    want = sum(0.5 * t['load_balance'] + 0.25 * t['z_loss'] + 2.0 * t['router_aux'] for t in terms) / 2
    assert abs(loss.item() - want.item()) < 1e-6
    assert objective.metrics['expert_load'] == max(t['expert_load'] for t in terms)
    assert objective.metrics['expert_load_1'] == terms[1]['expert_load']
    assert RouterLoss().coef == {'load_balance': 0.01, 'z_loss': 0.001, 'router_aux': 0.0}


def test_an_moe_student_gets_its_router_losses_by_default_and_a_dense_one_none():
    moe, dense = Transformer(config(top_k=3)), Transformer(config(n_experts=0))
    manager = ObjectiveManager.from_settings({'ce': {}}, [(1.0, {'ce': 1.0})], 'switch', None, moe)
    assert manager.objectives['router'].top_k == 3 and manager.curriculum.weights(0.5)['router'] == 1.0
    x = tokens()
    total, metrics = manager(moe, {'x': x, 'y': x}, 0.5)
    assert abs(total.item() - metrics['loss_ce'].item() - metrics['loss_router'].item()) < 1e-5
    assert 'expert_load_1' in metrics and 'router_entropy' in metrics
    with pytest.raises(ValueError, match="'router' needs a mixture of experts"):
        ObjectiveManager.from_settings({'ce': {}, 'router': {}}, [(1.0, {'ce': 1.0})], 'switch', None, dense)


def test_flops_per_token_count_the_experts_a_token_uses():
    model = Transformer(config(n_experts=8, top_k=2, n_shared_experts=1))
    expert = sum(p.numel() for p in model.layers[0].mlp.experts[0].parameters())
    others = model.num_params() - 8 * expert * 2  # 2 layers of 8 experts
    attention = 12 * 2 * 4 * 8 * 10  # QK^T and AV: n_layer * n_head * head_dim * T
    assert model.flops_per_token(10) == 6 * (others + 2 * expert * 2) + attention


def test_activation_checkpointing_gives_the_same_router_gradients():
    torch.manual_seed(0)
    model = Transformer(config(bitnet=True, n_shared_experts=1))
    grads = []
    for ckpt in (False, True):
        model.checkpoint_activations(ckpt)
        model.zero_grad()
        feats = {'router': []}
        logits = model(tokens(), feats=feats)
        (logits.square().mean() + RouterLoss(aux=0.1).loss({}, feats, None)).backward()
        assert len(feats['router']) >= 2
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_ternary_moe_round_trips_packs_and_samples_with_a_cache(tmp_path):
    torch.manual_seed(0)
    model = Transformer(config(bitnet=True, n_shared_experts=1)).eval()
    x = tokens()
    model.save_pretrained(tmp_path / 'online')
    hf = json.load(open(tmp_path / 'online' / 'config.json'))
    assert hf['model_type'] == 'bitnet_moe'  # transformers has no ternary MoE: it refuses
    with pytest.raises((ValueError, KeyError)):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'online')
    loaded = Transformer.from_pretrained(str(tmp_path / 'online'))
    with torch.no_grad():
        want = model(x)
        assert torch.equal(loaded(x), want)
        packed = loaded.freeze()
        assert isinstance(packed.layers[0].mlp, MoE) and (packed(x) - want).abs().max() < 1e-3
        packed.save_pretrained(tmp_path / 'packed')
        again = Transformer.from_pretrained(str(tmp_path / 'packed'))
        assert again.config.packed and torch.equal(again(x), packed(x))
        ref, got = {'hidden': []}, {'hidden': []}
        again(x, feats=ref)
        fused = fuse(again)  # every expert's gate/up in one call: the same block outputs
        fused(x, feats=got)
        from engine import FusedMLP
        assert all(type(m) is FusedMLP for m in fused.layers.modules() if isinstance(m, MLP))
        assert all((a - b).abs().max() < 1e-6 for a, b in zip(ref['hidden'], got['hidden']))
        cached = generate(fused, x[:, :4], 8, temperature=0)
        step = x[:, :4]
        for _ in range(8):  # no cache: the whole sequence every time
            step = torch.cat((step, fused(step)[:, -1:].argmax(-1)), 1)
        assert torch.equal(cached, step)


def test_upcycling_keeps_the_dense_model_and_then_trains_its_experts_apart():
    torch.manual_seed(0)
    dense = Transformer(config(n_experts=0, bitnet=False))
    x = tokens()
    with torch.no_grad():
        before = dense(x)
    moe = dense.upcycle(8, 2)
    assert moe.config.n_experts == 8 and moe.config.moe_intermediate_size == 48
    block = moe.layers[0].mlp
    assert isinstance(block, MoE) and block.gate.weight.std() > 0
    assert torch.equal(block.experts[0].up_proj.weight, block.experts[7].up_proj.weight)
    assert block.experts[0].up_proj.weight is not block.experts[7].up_proj.weight
    with torch.no_grad():
        assert (moe(x) - before).abs().max() < 1e-5
    with pytest.raises(ValueError, match='mixture of experts already'):
        moe.upcycle(8, 2)


def test_train_py_upcycles_a_dense_checkpoint_and_samples_from_it(tmp_path):
    """--moe with a dense init_from: the first step's CE is the dense model's; the checkpoint is a
    Qwen2-MoE that sample.py opens; a resume cannot change the experts."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = str(tmp_path / 'dense-model')  # its own folder: a run never writes into a model's
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=64)).save_pretrained(src)
    tiny = ['--batch_size=4', '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample.tokens=0',
            '--max_steps=2', '--eval_interval=2', f'--init_from={src}', '--bitnet=False']

    def run(*args, script='train.py'):
        return subprocess.run([sys.executable, script, *args], cwd=root, capture_output=True, text=True,
                              timeout=300)
    moe = "--moe={'n_experts': 4, 'top_k': 2}"
    first_ce = []
    for name, extra in (('dense', []), ('moe', [moe])):
        out = str(tmp_path / name)
        r = run(*tiny, *extra, f'--out_dir={out}')
        assert r.returncode == 0, r.stderr
        first_ce.append(json.loads(open(os.path.join(out, 'log.jsonl')).readline())['loss_ce'])
    assert abs(first_ce[0] - first_ce[1]) < 1e-5
    out = str(tmp_path / 'moe')
    cfg = json.load(open(os.path.join(out, 'ckpt_0000002', 'config.json')))
    assert cfg['architectures'] == ['Qwen2MoeForCausalLM'] and cfg['num_experts'] == 4
    r = run(f'--ckpt={out}', '--num_tokens=8', '--prompt=Hello', script='sample.py')
    assert r.returncode == 0 and r.stdout.startswith('Hello'), r.stderr
    r = run(*tiny, "--moe={'n_experts': 8, 'top_k': 2}", f'--out_dir={out}', '--init_from=resume',
            '--max_steps=3')
    assert r.returncode == 1 and 'was trained with moe.n_experts=4 (now 8)' in r.stderr and r.stderr.count('\n') == 1


# ------------------------------------------------- the MoE checkpoints people download

MOE_FAMILIES = {  # each as transformers makes it: Qwen2-MoE biases q, k and v, as every release does
    'mixtral': ('MixtralConfig', dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    'qwen3_moe': ('Qwen3MoeConfig', dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                         head_dim=16, norm_topk_prob=True)),
    'qwen2_moe': ('Qwen2MoeConfig', dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=48)),
}


def hf_moe(kind, vocab=64, seed=0):
    """A 2-layer MoE of the family, its weights all random (transformers starts routers at zero and
    norms at one, which would hide a wrong routing or a misplaced norm)."""
    name, extra = MOE_FAMILIES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, name)(**dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                                      | extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'norm' in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    return model


def router_choices(logits, k):
    return logits.float().topk(k, dim=-1).indices.sort(dim=-1).values


@pytest.mark.parametrize('kind', MOE_FAMILIES)
def test_each_released_moe_family_loads_routes_and_saves_back_as_transformers_does(tmp_path, kind):
    ref = hf_moe(kind)
    ref.save_pretrained(tmp_path / 'hf')
    ours = Transformer.from_pretrained(str(tmp_path / 'hf')).eval()
    assert (ours.config.n_experts, ours.config.top_k) == (4, 2)
    assert ours.config.n_shared_experts == (2 if kind == 'qwen2_moe' else 0)
    assert ours.config.qkv_bias == (kind == 'qwen2_moe') and ours.config.qk_norm == (kind == 'qwen3_moe')
    x = tokens()
    with torch.no_grad():
        theirs = ref(x, output_router_logits=True)
        feats = {'router': []}
        assert (ours(x, feats=feats) - theirs.logits).abs().max() < 1e-4
    for mine, their in zip(feats['router'], theirs.router_logits, strict=True):  # every layer, every token
        assert torch.equal(router_choices(mine, 2), router_choices(their, 2))
    ours.save_pretrained(tmp_path / 'ours')
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'ours').eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        assert (back(x).logits - ours(x)).abs().max() < 1e-4


@pytest.mark.parametrize('kind', MOE_FAMILIES)
def test_load_balance_is_each_familys_own_loss_and_ternary_at_lambda_0_is_the_fp_moe(tmp_path, kind):
    import importlib
    from bitlinear import set_lambda
    module = importlib.import_module(f'transformers.models.{kind}.modeling_{kind}')
    torch.manual_seed(1)
    for z in (torch.randn(40, 4), torch.randn(7, 4)):
        theirs = module.load_balancing_loss_func((z,), 4, 2)
        assert abs(theirs.item() - 2 * router_losses(z, 2)['load_balance'].item()) < 1e-5
    hf_moe(kind).save_pretrained(tmp_path)
    fp = Transformer.from_pretrained(str(tmp_path)).eval()
    student = Transformer.from_pretrained(str(tmp_path)).to_bitnet([tokens()]).eval()
    set_lambda(student, 0.0)
    with torch.no_grad():
        assert (student(tokens()) - fp(tokens())).abs().max() < 1e-5
    set_lambda(student, 1.0)
    student.save_pretrained(tmp_path / 'ternary')
    assert json.load(open(tmp_path / 'ternary' / 'config.json'))['model_type'] == 'bitnet_moe'
    again = Transformer.from_pretrained(str(tmp_path / 'ternary')).eval()
    assert again.config.family == fp.config.family and again.config.n_experts == 4
    with torch.no_grad():
        assert torch.equal(again(tokens()), student(tokens()))


@pytest.mark.parametrize('family', ['llama3', 'qwen2.5', 'qwen3', 'mistral'])
def test_upcycling_each_dense_family_keeps_its_function_and_saves_as_its_moe_sibling(tmp_path, family):
    from test_families import hf_model
    hf_model(family).save_pretrained(tmp_path / 'dense')
    dense = Transformer.from_pretrained(str(tmp_path / 'dense')).eval()
    x = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = dense(x)
        moe = dense.upcycle(4, 2)
        assert (moe(x) - before).abs().max() < 1e-5
    moe.save_pretrained(tmp_path / 'moe')
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'moe').eval()
    sibling = {'llama3': 'Qwen2Moe', 'qwen2.5': 'Qwen2Moe', 'qwen3': 'Qwen3Moe', 'mistral': 'Mixtral'}[family]
    assert type(theirs).__name__ == f'{sibling}ForCausalLM'
    with torch.no_grad():
        assert (theirs(x).logits - before).abs().max() < 1e-4


@pytest.mark.parametrize('kind, ranks', [('mixtral', 1), ('qwen3_moe', 1), ('qwen2_moe', 1), ('mixtral', 2)])
def test_two_ternary_training_steps_from_each_moe_familys_tiny_model(tmp_path, kind, ranks):
    """train.py converts the downloaded-style MoE to ternary and trains it with its router losses; the
    Mixtral one also on two ranks under FSDP2. The checkpoint keeps the family."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf_moe(kind, vocab=320).save_pretrained(tmp_path / 'hf')
    launch = [sys.executable] + (['-m', 'torch.distributed.run', '--nproc_per_node=2'] if ranks > 1 else [])
    out = tmp_path / 'out'
    cmd = [*launch, 'train.py', f'--init_from={tmp_path / "hf"}', '--tokenizer=bytes', '--bitnet=True',
           f'--fsdp={ranks > 1}', f'--gradient_accumulation_steps={ranks}', '--batch_size=2', '--block_size=32',
           '--max_steps=2', '--eval_interval=2',
           '--eval_iters=1', '--log_interval=1', '--sample.tokens=0', f'--out_dir={out}']
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [json.loads(line) for line in open(out / 'log.jsonl')]
    assert [rec['step'] for rec in recs] == [1, 2]
    assert all(math.isfinite(recs[-1][k]) for k in ('loss_ce', 'loss_router', 'val_loss'))
    saved = Transformer.from_pretrained(str(out / 'ckpt_0000002'))
    assert saved.config.bitnet and saved.config.n_experts == 4
    assert saved.config.family == {'mixtral': 'mistral', 'qwen3_moe': 'qwen3', 'qwen2_moe': 'qwen2'}[kind]
