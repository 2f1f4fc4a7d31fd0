"""LoRA on a frozen base (lora.py, bitlinear.py, train.py, sample.py, export.py): what trains, what stays bit-identical, the
STE gradient through packed weights, and the adapter files against PEFT on transformers' models."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from bitlinear import BitLinear, PackedBitLinear, activation_quant, freeze, weight_quant
from lora import LoRALinear, add_lora, merge_lora, set_adapters
from conftest import ROOT
from model import ModelConfig, Transformer

TINY = ['--batch_size=2', '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample.tokens=0',
        '--warmup_steps=1', '--learning_rate=1e-2']
PEFT = 'base_model.model.model.layers.'


def run(args, script='train.py', torchrun=False):
    launch = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2'] if torchrun else [sys.executable]
    return subprocess.run([*launch, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def tiny(bitnet=True, seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                                   intermediate_size=96, max_seq_len=128, bitnet=bitnet))


@pytest.mark.parametrize('shape', [(3, 300), (2, 5, 300)])
def test_grad_x_through_packed_weights_is_the_ste_gradient(shape):
    torch.manual_seed(0)
    lin = BitLinear(300, 70)  # K = 300: the kernel layout pads K to 512
    w_q, gamma = weight_quant(lin.weight)
    packed = freeze(torch.nn.Sequential(lin))[0]
    assert isinstance(packed, PackedBitLinear)
    x = torch.randn(shape, requires_grad=True)
    g = torch.randn(*shape[:-1], 70)
    packed(x).backward(g)
    # 1) the latent layer the packed one was frozen from, at lambda 1: the same STE gradient, bit for bit
    x_ref = x.detach().clone().requires_grad_()
    lin(x_ref).backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    # 2) plain autograd on the unpacked ternary weights: straight through the activation quantizer
    x_ste = x.detach().clone().requires_grad_()
    x_q, s = activation_quant(x_ste.detach())
    F.linear(x_ste + (x_q / s - x_ste).detach(), w_q * gamma).backward(g)
    torch.testing.assert_close(x.grad, x_ste.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(x.grad, (g.reshape(-1, 70) @ (w_q * gamma)).view(shape))


def test_lora_trains_only_adapters_and_leaves_the_packed_base_bit_identical():
    model = tiny().freeze().requires_grad_(False)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    add_lora(model.layers, rank=4, alpha=8.0)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 2 * 7
    with torch.no_grad():  # B starts at zero: the adapted model is the base, exactly
        assert torch.equal(model(x), before)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all('.lora_A.' in n or '.lora_B.' in n for n in trained)
    # PEFT's names: the adapted layer keeps its path, the base moves under base_layer
    assert 'layers.0.self_attn.q_proj.lora_A.weight' in trained
    assert 'layers.0.self_attn.q_proj.base_layer.weight' in model.state_dict()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = {k.replace('.base_layer', ''): v for k, v in model.state_dict().items() if '.lora_' not in k}
    assert after.keys() == base.keys() and all(torch.equal(after[k], base[k]) for k in base)
    assert all(after[k].dtype == torch.uint8 for k in base if k.endswith('proj.weight'))  # still 2-bit codes
    with torch.no_grad():
        adapted = model(x)
        set_adapters(model, False)  # DPO's reference: the base, bit for bit
        assert torch.equal(model(x), before)
        set_adapters(model, True)
        assert torch.equal(model(x), adapted) and not torch.equal(adapted, before)


def test_merge_folds_fp_adapters_and_keeps_ternary_ones():
    fp = tiny(bitnet=False)
    add_lora(fp.layers, rank=4, alpha=4.0)
    for m in fp.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    x = torch.randint(300, (2, 16))
    with torch.no_grad():
        adapted = fp(x)
        merge_lora(fp)
        assert not any(isinstance(m, LoRALinear) for m in fp.modules())
        assert type(fp.layers[0].self_attn.q_proj) is torch.nn.Linear
        torch.testing.assert_close(fp(x), adapted, rtol=1e-4, atol=1e-5)
    ternary = add_lora(tiny().freeze().layers, rank=4, alpha=4.0)
    assert sum(isinstance(m, LoRALinear) for m in merge_lora(ternary).modules()) == 14


def hf_llama(path):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def save_random_adapters(model, base, ckpt, rank=4, alpha=8.0):
    """Rank-4 adapters on every target of `model`, B random (not zero, so they change the output),
    written by hand in PEFT's layout as adapters of the checkpoint `base`."""
    add_lora(model.layers, rank, alpha)
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    os.makedirs(ckpt)
    from safetensors.torch import save_file
    save_file({PEFT + k: v for k, v in model.layers.state_dict().items() if '.lora_' in k},
              os.path.join(ckpt, 'adapter_model.safetensors'))
    json.dump(dict(peft_type='LORA', task_type='CAUSAL_LM', r=rank, lora_alpha=alpha, target_modules=[
        'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'],
        base_model_name_or_path=base), open(os.path.join(ckpt, 'adapter_config.json'), 'w'))
    return model


def adapted(base, ckpt):
    """Our model from the base, with the adapters of ckpt, read independently of train.py and sample.py."""
    cfg = json.load(open(os.path.join(ckpt, 'adapter_config.json')))
    model = Transformer.from_pretrained(base)
    model = model.freeze() if model.config.bitnet else model
    add_lora(model.layers, cfg['r'], cfg['lora_alpha'], cfg['target_modules'])
    sd = load_file(os.path.join(ckpt, 'adapter_model.safetensors'))
    assert all(k.startswith(PEFT) and k.endswith(('.lora_A.weight', '.lora_B.weight')) for k in sd)
    missing, unexpected = model.layers.load_state_dict({k.removeprefix(PEFT): v for k, v in sd.items()}, strict=False)
    assert not unexpected and not [k for k in missing if '.lora_' in k]
    return model.eval()


def test_peft_loads_our_adapters_onto_transformers_llama(tmp_path):
    peft = pytest.importorskip('peft')
    transformers = pytest.importorskip('transformers')
    base, out = str(tmp_path / 'base'), str(tmp_path / 'lora')
    hf_llama(base)
    r = run([*TINY, f'--init_from={base}', '--bitnet=False', '--lora.rank=4', '--lora.alpha=8',
             '--lora.targets=q_proj,v_proj,down_proj', '--max_steps=3', '--eval_interval=3', f'--out_dir={out}'])
    assert r.returncode == 0, r.stderr
    assert '3,072 trained' in r.stdout  # 2 layers x (q 4x(64+64) + v 4x(64+32) + down 4x(96+64))
    ckpt = os.path.join(out, 'ckpt_0000003')
    assert {'adapter_config.json', 'adapter_model.safetensors', 'train_state.pt'} <= set(os.listdir(ckpt))
    assert 'model.safetensors' not in os.listdir(ckpt)  # the base is not copied
    ours = adapted(base, ckpt)
    assert any(v.abs().max() > 0 for k, v in ours.state_dict().items() if '.lora_B.' in k)  # it trained
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), ckpt).eval()
    assert sorted(ref.peft_config['default'].target_modules) == ['down_proj', 'q_proj', 'v_proj']
    x = torch.randint(300, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() <= 1e-4
        with ref.disable_adapter():  # and the adapters change the logits: the check is not vacuous
            assert (ours(x) - ref(x).logits).abs().max().item() > 1e-3
    # export.py merges them into the fp base and writes a plain checkpoint that transformers opens
    merged = str(tmp_path / 'merged')
    r = run([f'--ckpt={out}', f'--merge={merged}'], script='export.py')
    assert r.returncode == 0, r.stderr
    plain = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert (plain(x).logits - ref(x).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize('mode', ['online', 'offline'])
def test_peft_targets_transformers_bitnet_layers(tmp_path, mode):
    """PEFT wraps transformers' AutoBitLinear (an nn.Linear subclass), latent (online) or packed (offline)."""
    peft = pytest.importorskip('peft')
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('accelerate')
    base, ckpt = str(tmp_path / 'base'), str(tmp_path / 'ckpt')
    model = tiny()
    (model.freeze() if mode == 'offline' else model).save_pretrained(base)
    save_random_adapters(model.freeze() if mode == 'online' else model, base, ckpt)
    x = torch.randint(300, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.compiler.set_stance('force_eager'), torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        assert type(hf).__name__ == 'BitNetForCausalLM'
        ref = peft.PeftModel.from_pretrained(hf, ckpt).eval()
        wrapped = ref.base_model.model.model.layers[0].self_attn.q_proj
        assert type(wrapped.base_layer).__name__ == 'AutoBitLinear'
        theirs = ref(x).logits
        with ref.disable_adapter():  # the adapters matter: the comparison is not vacuous
            assert (theirs - ref(x).logits).abs().max().item() > 1e-3
        diff = (adapted(base, ckpt)(x) - theirs).abs()
    if mode == 'offline':  # packed weights, as ours: the same logits
        assert diff.max().item() <= 1e-4
    else:  # transformers' fp fake-quantization rounds an activation now and then to another int8 code
        # than our exact integer product (see bitlinear.BitLinear.reference); the rest agrees
        assert (diff <= 1e-4).float().mean().item() >= 0.95 and diff.max().item() <= 1e-2


def test_train_lora_on_a_ternary_checkpoint_resumes_exactly_and_dpo_starts_at_ln2(tmp_path):
    base, one, two = (str(tmp_path / n) for n in ('base', 'one', 'two'))
    tiny().save_pretrained(base)  # a ternary checkpoint (latent weights): LoRA packs it
    lora = [*TINY, f'--init_from={base}', '--lora.rank=4', '--max_steps=6', '--eval_interval=3']
    r = run([*lora, f'--out_dir={one}'])
    assert r.returncode == 0, r.stderr
    assert '7,424 trained' in r.stdout  # 2 layers x 4 x (q, k, v, o, gate, up, down: in + out)
    assert json.load(open(f'{one}/ckpt_0000006/adapter_config.json'))['base_model_name_or_path'] == base
    r = run([*lora, f'--out_dir={two}', '--ckpt.interval=3'])
    assert r.returncode == 0, r.stderr
    shutil.rmtree(f'{two}/ckpt_0000006')  # as if stopped after step 3's checkpoint
    r = run([*lora, f'--out_dir={two}', '--init_from=resume'])
    assert r.returncode == 0 and 'resumed from' in r.stdout, r.stderr
    assert [rec['loss'] for rec in log(one)] == [rec['loss'] for rec in log(two)]
    # DPO with no teacher named: the reference is the frozen base (adapters off), so step 1 is ln 2
    r = run([*TINY, f'--init_from={base}', '--lora.rank=4', '--max_steps=2', '--eval_interval=2',
             f'--out_dir={tmp_path / "dpo"}', '--dpo_data=config/preferences.jsonl', '--block_size=128',
             "--objectives={'ce': {}, 'dpo': {'beta': 0.1}}", "--curriculum=[(1.0, {'ce': 1.0, 'dpo': 1.0})]"])
    assert r.returncode == 0, r.stderr
    first, second = log(tmp_path / 'dpo')
    assert first['loss_dpo'] == pytest.approx(0.693147, abs=1e-6) and second['loss_dpo'] != first['loss_dpo']


@pytest.mark.parametrize('args, message', [
    (['--lora.rank=4'], "error: lora.rank=4 adapts a trained model: set init_from"),
    (['--lora.rank=4', '--init_from=BASE', '--lora.targets=q_proj,qkv'], "lora.targets among q_proj,k_proj"),
    (['--lora.rank=4', '--init_from=BASE', '--lambda_warmup=0.1'], "and no fsdp or lambda_warmup"),
])
def test_bad_lora_settings_stop_in_one_line(tmp_path, args, message):
    tiny().save_pretrained(tmp_path / 'base')
    r = run([*TINY, *[a.replace('BASE', str(tmp_path / 'base')) for a in args], f'--out_dir={tmp_path / "o"}'])
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_sample_runs_a_ternary_base_with_adapters_and_refuses_to_merge(tmp_path):
    base, out = str(tmp_path / 'base'), str(tmp_path / 'lora')
    tiny().save_pretrained(base)
    r = run([*TINY, f'--init_from={base}', '--lora.rank=4', '--max_steps=2', '--eval_interval=2', f'--out_dir={out}'])
    assert r.returncode == 0, r.stderr
    r = run([f'--ckpt={out}', '--num_tokens=5', '--temperature=0'], script='sample.py')
    assert r.returncode == 0 and 'packed ternary' in r.stdout, r.stderr
    r = run([f'--ckpt={out}', f'--merge={tmp_path / "m"}'], script='export.py')
    assert r.returncode != 0 and 'error: LoRA adapters on a ternary base cannot be merged' in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'm')


@pytest.mark.slow
def test_lora_under_ddp_matches_one_process(tmp_path):
    base = str(tmp_path / 'base')
    tiny().save_pretrained(base)
    common = [*TINY, f'--init_from={base}', '--lora.rank=4', '--max_steps=4', '--eval_interval=4',
              '--gradient_accumulation_steps=2']
    assert run([*common, f'--out_dir={tmp_path / "one"}']).returncode == 0
    r = run([*common, f'--out_dir={tmp_path / "two"}'], torchrun=True)
    assert r.returncode == 0, r.stderr
    a, b = log(tmp_path / 'one'), log(tmp_path / 'two')
    assert len(a) == len(b) == 4 and all(abs(x['loss'] - y['loss']) <= 1e-5 for x, y in zip(a, b))


def test_a_lora_checkpoint_opens_only_on_the_base_it_was_trained_on(tmp_path):
    """A LoRA run records its base's identity. Its base damaged (a flipped byte: the manifest tells),
    or replaced by another intact model at the same path, sample.py, eval.py and export.py refuse the
    adapters in one line, as a resume of the LoRA run does; the base put back, they all run."""
    hf, base_run, other, out = (str(tmp_path / n) for n in ('hf', 'base', 'other', 'lora'))
    tiny().save_pretrained(hf)
    for folder, seed in ((base_run, 1), (other, 2)):
        r = run([*TINY, f'--init_from={hf}', '--max_steps=1', '--eval_interval=1', f'--seed={seed}', f'--out_dir={folder}'])
        assert r.returncode == 0, r.stderr
    base = os.path.join(base_run, 'ckpt_0000001')
    r = run([*TINY, f'--init_from={base_run}', '--lora.rank=4', '--max_steps=2', '--eval_interval=2', f'--out_dir={out}'])
    assert r.returncode == 0, r.stderr
    readers = [('sample.py', [f'--ckpt={out}', '--num_tokens=3', '--temperature=0']),
               ('eval.py', [f'--ckpt={out}', '--tasks=']),
               ('export.py', [f'--ckpt={out}', f'--gguf={tmp_path / "lora.gguf"}']),
               ('train.py', [*TINY, f'--out_dir={out}', '--init_from=resume', '--lora.rank=4', '--max_steps=3'])]
    shutil.copytree(base, tmp_path / 'saved')
    weights = os.path.join(base, 'model.safetensors')
    flipped = bytearray(open(weights, 'rb').read())
    flipped[-7] ^= 1
    open(weights, 'wb').write(bytes(flipped))
    for script, args in readers:
        r = run(args, script=script)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, (script, r.stderr)
        assert 'sha256' in r.stderr or 'damaged' in r.stderr or 'changed' in r.stderr, (script, r.stderr)
    shutil.rmtree(base)
    shutil.copytree(os.path.join(other, 'ckpt_0000001'), base)  # intact, manifest and all: another model
    for script, args in readers:
        r = run(args, script=script)
        assert r.returncode != 0 and 'its files have changed since' in r.stderr, (script, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (script, r.stderr)
    shutil.rmtree(base)
    shutil.copytree(tmp_path / 'saved', base)
    for script, args in readers[:2] + readers[3:]:
        r = run(args, script=script)
        assert r.returncode == 0, (script, r.stderr)
