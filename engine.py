"""
Inference: sampling with a KV cache, and a fused model for fast decode.

Generating a token runs the model on one new position. Its keys and values are all that
the next positions need from it, so each block keeps them in a cache of shape
(2, B, n_kv_head, T_max, head_dim): the prompt is run once (prefill), then each step
runs one position and attends over the cache (decode). model.Transformer.forward takes
the cache and the position.

Decode at batch 1 reads every weight once per token, so its speed is the speed at which
weights stream from memory. A frozen ternary model (bitlinear.freeze) reads 2-bit
weights; `fuse` then removes what is left around them: q/k/v (and gate/up) read the same
input, so each group becomes one packed matrix (one activation quantization and one
kernel call, every row keeping its gamma: the same numbers), and the fp head, most of
the bytes a small model reads per token, gets int8 rows (kernels.pack_int8, 4x fewer
bytes than fp32; its held-out cost is in docs/llama_cpp.md). `profile_token` shows where
the time of a decode token goes. On a GPU a small model's decode step is hundreds of
kernels of a few microseconds, which Python launches more slowly than they run:
`GraphDecoder` replays the whole step as one CUDA graph.

`rollout` samples many completions at once for reinforcement learning (GRPO, rl.py):
prompts of different lengths are left-padded so that every row's next token sits in the
same column, and a padding mask keeps the pads out of attention.

`llama_cpp_forward` runs a GGUF export through llama.cpp behind the same signature as a
model's forward (token ids to logits), so that both are scored by the same code.
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from bitlinear import PackedBitLinear
from kernels import best, cpp_extension, holding_weights, pack_int8, ternary_linear
from model import MLP, Attention, Transformer


def llama_cpp_model(path, max_len=2048):
    """(llama.cpp's model of a GGUF file, context length): llama-cpp-python's, keeping the
    logits of every position it evaluates (`scores`), its context the model's cut to
    max_len (llama.cpp itself rounds the context it allocates up)."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("running a GGUF file needs llama-cpp-python: "
                          "pip install llama-cpp-python") from None
    meta = llama_cpp.Llama(path, vocab_only=True, verbose=False).metadata
    arch = meta['general.architecture']
    n_ctx = min(int(meta[f'{arch}.context_length']), max_len)
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          logits_all=True, verbose=False)
    return llm, n_ctx


def llama_cpp_forward(path, max_len=2048):
    """(forward, context length) for a GGUF file run by llama.cpp: each row is evaluated
    from an empty cache, and the logits of every position are returned."""
    llm, n_ctx = llama_cpp_model(path, max_len)

    def forward(x):
        rows = []
        for ids in x.tolist():
            llm.reset()
            llm.eval(ids)
            rows.append(torch.from_numpy(llm.scores[:len(ids)].copy()))
        return torch.stack(rows)
    return forward, n_ctx


def llama_cpp_greedy(path, max_len=2048):
    """A greedy decoder for a GGUF file run by llama.cpp: answer(ids, max_new_tokens,
    stop_ids, vocab) -> the new token ids, each the argmax of llama.cpp's logits over the
    tokenizer's `vocab` ids (no sampler), ending at the first stop id, which it keeps,
    as `rollout` does."""
    llm, _ = llama_cpp_model(path, max_len)

    def answer(ids, max_new_tokens, stop_ids, vocab):
        llm.reset()
        llm.eval(ids)
        new = []
        while len(new) < max_new_tokens:
            token = int(llm.scores[llm.n_tokens - 1, :vocab].argmax())
            new.append(token)
            if token in stop_ids:
                break
            llm.eval([token])
        return new
    return answer


@torch.no_grad()
@holding_weights()  # the weights hold still while it generates: each is quantized once
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, eos_id=None,
             vocab=None):
    """Sample continuations of idx (B, T): the prompt once, then one position per new
    token (greedy at temperature 0, else from the softmax at `temperature`, cut to the
    top_k logits). Stops early when every row produced eos_id. `vocab` leaves out an
    embedding's padding rows beyond the tokenizer's.
    Returns idx with the new tokens appended."""
    cfg = model.config
    B, T = idx.shape
    p = next(model.parameters())
    shape = (2, B, cfg.n_kv_head, T + max_new_tokens, cfg.head_dim)  # K and V
    cache = [torch.empty(shape, device=p.device, dtype=p.dtype)
             for _ in range(cfg.n_layer)]
    logits = model(idx, cache, 0)
    for _ in range(max_new_tokens):
        logits = logits[:, -1, :vocab].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # the largest at 0 first, and a temperature above 0 stays above 0 in float32:
            # however small it is, numbers <= 0 are divided (never 0 / 0)
            smallest = torch.finfo(logits.dtype).tiny
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, smallest)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        pos = idx.size(1)
        idx = torch.cat((idx, nxt), dim=1)
        if eos_id is not None and (nxt == eos_id).all():
            break
        logits = model(nxt, cache, pos)
    return idx


class GraphDecoder:
    """Greedy decoding (generate at temperature 0) whose every new token is one replay of a
    CUDA graph. A decode step of a small model is hundreds of kernels of a few microseconds
    each, and launching them one by one from Python costs more than running them; a graph
    launches the recorded step at once. A graph replays fixed shapes and addresses, so the
    step is written for that: the cache is a fixed buffer attended whole (the keys past the
    position masked), the position is a tensor on the device that the step advances, and
    the next token is picked inside the step. Made for one batch size and length, captured
    on its first decode step and reused by every call. On a CPU the same step runs eagerly
    (the tests compare it with generate)."""

    def __init__(self, model, batch, max_len, vocab=None):
        cfg = model.config
        p = next(model.parameters())
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds max_seq_len={cfg.max_seq_len}")
        self.model, self.vocab, self.max_len = model, vocab, max_len
        # zeros: masked keys get no weight, but their values still enter SDPA's product
        # (0 x NaN is NaN)
        shape = (2, batch, cfg.n_kv_head, max_len, cfg.head_dim)
        self.cache = [torch.zeros(shape, device=p.device, dtype=p.dtype)
                      for _ in range(cfg.n_layer)]
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=p.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        self.pos = torch.zeros((), dtype=torch.long, device=p.device)  # self.token's
        self.graph = None

    def pick(self, logits):
        self.token.copy_(logits[:, -1, :self.vocab].argmax(-1, keepdim=True))
        self.tokens.index_copy_(1, self.pos.view(1), self.token)

    def forward(self):
        """The model's forward for self.token at self.pos, in shapes that never change:
        each block writes its K/V at the position (a tensor) into its fixed cache, and
        attends over the whole cache, the keys past the position masked out. The model's
        own modules, in the model's order (its forward slices by a Python position)."""
        model, pos = self.model, self.pos.view(1)
        x = model.embed_tokens(self.token)  # (B, 1, C)
        B = x.shape[0]
        cos, sin = model.cos[pos].to(x.dtype), model.sin[pos].to(x.dtype)
        keys = torch.arange(self.max_len, device=x.device)
        seen = keys <= pos
        if model.config.sliding_window:
            seen &= keys > pos - model.config.sliding_window
        seen = seen[None, None, None]  # (1, 1, 1, max_len): every row, head and query
        for block, cache in zip(model.layers, self.cache):
            attention = block.self_attn
            q, k, v = attention.heads(block.input_layernorm(x), cos, sin)
            cache[0].index_copy_(2, pos, k)
            cache[1].index_copy_(2, pos, v)
            y = F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=seen,
                                               enable_gqa=attention.n_kv_head != attention.n_head)
            y = y.transpose(1, 2).reshape(B, 1, -1)
            x = x + attention.o_proj(attention.attn_sub_norm(y))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return model.lm_head(model.norm(x))

    def step(self):
        logits = self.forward()
        self.pos += 1
        self.pick(logits)

    def capture(self):
        # what the capture records runs once first, on a side stream as PyTorch asks
        # (lazy initialisations, the kernels' build)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    @torch.no_grad()
    def __call__(self, idx, max_new_tokens):
        """idx (batch, T) and its greedy continuation of max_new_tokens, as generate."""
        T = idx.shape[1]
        if T + max_new_tokens > self.max_len:
            raise ValueError(f"{T} + {max_new_tokens} tokens exceed max_len={self.max_len}")
        logits = self.model(idx, self.cache, 0)  # prefill, eagerly
        self.tokens[:, :T] = idx
        self.pos.fill_(T)
        self.pick(logits)
        for _ in range(max_new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            elif self.tokens.is_cuda:
                self.capture()  # one step, run for real; the graph records the next
            else:
                self.step()
        return self.tokens[:, :T + max_new_tokens].clone()


def top_p_filter(probs, top_p):
    """The smallest set of most likely tokens whose probability reaches top_p (nucleus
    sampling, Holtzman et al. 2020), renormalised; (B, V)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the more likely tokens
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
@holding_weights()  # the weights hold still while it samples: each is quantized once
def rollout(model, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(),
            seeds=None, vocab=None, use_cache=True, all_done=None):
    """Sample a completion for each prompt (lists of token ids), batched. Prompts are
    left-padded to one length P; a row stops after any of stop_ids (EOS, the chat's end
    token) or max_new_tokens. Row b draws its uniforms from its own generator seeded
    seeds[b], so a row samples the same tokens whatever batch it is in. Temperature 0 is
    greedy. Without use_cache every step runs the whole sequence again (the reference
    the cache is tested against). all_done(done) says when to stop (under FSDP every rank
    must run each forward until all ranks are done). Returns x (B, P + L) prompts and
    completions (0 after a row stopped), valid (B, P + L) the real tokens, mask (B, L) the
    completion tokens, and logp (B, L) their log-probabilities under softmax(logits /
    temperature), L being the longest completion."""
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    x = torch.zeros(B, P + max_new_tokens, dtype=torch.long, device=device)
    valid = torch.zeros(B, P + max_new_tokens, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        x[b, P - len(p):P] = torch.tensor(p, device=device)
        valid[b, P - len(p):P] = True
    logp = torch.zeros(B, max_new_tokens, device=device)
    seeds = range(B) if seeds is None else seeds
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    all_done = all_done or (lambda d: bool(d.all()))
    cache = None
    if use_cache:
        cfg = model.config
        shape = (2, B, cfg.n_kv_head, P + max_new_tokens, cfg.head_dim)  # K and V
        cache = [torch.empty(shape, device=device, dtype=next(model.parameters()).dtype)
                 for _ in range(cfg.n_layer)]
    L = 0  # tokens sampled so far
    while L < max_new_tokens and not all_done(done):
        if not use_cache:
            logits = model(x[:, :P + L], valid=valid[:, :P + L])
        elif L == 0:  # prefill
            logits = model(x[:, :P], cache, 0, valid=valid[:, :P])
        else:  # the last token, attending over the cache
            logits = model(x[:, P + L - 1:P + L], cache, P + L - 1, valid=valid[:, :P + L])
        z = logits[:, -1, :vocab].float()
        if temperature == 0:
            tokens = z.argmax(-1)
            logprobs = F.log_softmax(z, -1)
        else:
            logprobs = F.log_softmax(z / temperature, -1)
            probs = top_p_filter(logprobs.exp(), top_p)
            u = torch.stack([torch.rand(1, generator=g) for g in generators]).to(device)
            # inverse CDF; the clamp guards against a cumulative sum just under 1
            tokens = torch.searchsorted(probs.cumsum(-1), u, right=True).squeeze(1)
            tokens = tokens.clamp(max=probs.size(-1) - 1)
        tokens = tokens.masked_fill(done, 0)
        x[:, P + L] = tokens
        valid[:, P + L] = ~done
        logp[:, L] = logprobs.gather(-1, tokens[:, None]).squeeze(1).masked_fill(done, 0.0)
        done = done | torch.isin(tokens, stop)
        L += 1
    mask = valid[:, P:P + L]
    return x[:, :P + L], valid[:, :P + L], mask, logp[:, :L]


@torch.no_grad()
def teacher_text(model, starts, new_tokens, seeds, greedy=0, stop_ids=(), vocab=None,
                 batch=16):
    """Text a model writes itself, for a student to learn from (LLM-QAT, Liu et al.
    2023): each start (token ids: a random first token, or a chat prompt) continued
    greedily for `greedy` tokens, then sampled at temperature 1 until `new_tokens` in
    all or one of stop_ids. Row i samples from its own generator seeded seeds[i]
    (rollout), so its text depends on its seed, not on its batch. Returns each start
    with its continuation, as lists of ids."""
    texts = []
    for i in range(0, len(starts), batch):
        rows, row_seeds = starts[i:i + batch], seeds[i:i + batch]
        if greedy:  # the first tokens (no stop: a stop would end the row's text here)
            x, valid, _, _ = rollout(model, rows, greedy, temperature=0, vocab=vocab)
            rows = [row[keep].tolist() for row, keep in zip(x, valid)]
        x, valid, _, _ = rollout(model, rows, new_tokens - greedy, stop_ids=stop_ids,
                                 seeds=row_seeds, vocab=vocab)
        texts += [row[keep].tolist() for row, keep in zip(x, valid)]
    return texts


def complete(model, enc, prompts, n, temperature=0.0, top_k=None):
    """The text that follows each prompt (up to n tokens,
    fewer where the context ends)."""
    texts = []
    for prompt in prompts:
        device = next(model.parameters()).device
        x = torch.tensor([enc.encode_ordinary(prompt)], device=device)
        room = min(n, model.config.max_seq_len - x.size(1))
        y = generate(model, x, room, temperature, top_k, vocab=enc.n_vocab)
        texts.append(enc.decode(y[0, x.size(1):].tolist()))
    return texts


class FusedLinear(nn.Module):
    """Packed matrices that read one input as one matrix, each row keeping its gamma:
    one activation quantization and one kernel call; the outputs split per matrix. Its
    bytes are the packed layers' own (fuse): not in a state dict."""

    def __init__(self, packed, gammas, rows):
        super().__init__()
        self.register_buffer('packed', packed, persistent=False)
        self.register_buffer('gammas', gammas, persistent=False)
        self.rows = rows

    def forward(self, x):
        return ternary_linear(x, self.packed, self.gammas).split(self.rows, -1)


class FusedAttention(Attention):
    """Attention whose q, k and v come from one FusedLinear, `qkv` (fuse)."""

    def projections(self, x):
        return self.qkv(x)


class FusedMLP(MLP):
    """A gated MLP whose gate and up projections come from one FusedLinear, `gate_up`."""

    def gate_and_up(self, x):
        return self.gate_up(x)


class Int8Head(nn.Linear):
    """The fp head read as int8 rows (kernels.pack_int8: 4x fewer bytes than fp32; its
    held-out cost in docs/llama_cpp.md), a copy beside `weight`, which stays (tied to
    the embedding, and in the state dict)."""

    def forward(self, x):
        return ternary_linear(x, self.int8_weight, self.int8_weight_scale)


# up to this many rows a step runs as one call; at 50 rows (rl.py's held-out scoring) the
# call's scalar loops (attention, SiLU) took 8% longer than the eager ops they replace
ONE_CALL_ROWS = 8


class FusedTransformer(Transformer):
    """fuse's model where every block is plain (decodes_in_cpp): on the CPU, a step of one
    new token per row (up to ONE_CALL_ROWS rows) with a cache is one C++ call,
    kernels.decode_step: the norms, the fused projections, RoPE, the cache write,
    attention, the MLP and the int8 head, in the forward's order (eagerly each is a Python
    call and an ATen dispatch, about 75 a layer, which cost more than a small model's
    matmuls). Everything else, and anything torch.compile traces, is Transformer's
    forward."""

    def forward(self, idx, cache=None, pos=0, causal=True, feats=None, valid=None, keep=None):
        one_step = idx.shape[1] == 1 and cache is not None and feats is None and keep is None
        one_step = one_step and idx.shape[0] <= ONE_CALL_ROWS
        eager_cpu = idx.device.type == 'cpu' and not torch.compiler.is_compiling()
        if not (one_step and eager_cpu and best('cpu') == 'cpp'):
            return super().forward(idx, cache, pos, causal, feats, valid, keep)
        cfg = self.config
        if pos + 1 > cfg.max_seq_len:
            raise ValueError(f"{pos + 1} tokens exceed max_seq_len={cfg.max_seq_len}")
        shape = [cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.sliding_window,
                 cfg.act == 'relu2', cpp_extension().simd()]
        head = self.lm_head
        logits = cpp_extension().decode_step(
            idx.view(-1), self.embed_tokens.weight, self.step_tensors, cache,
            NO_TENSOR if valid is None else valid, pos, self.cos, self.sin, self.norm.weight,
            head.int8_weight, head.int8_weight_scale, shape, cfg.norm_eps, self.step_times)
        return logits[:, None]  # (B, 1, vocab)

    def _apply(self, fn, recurse=True):  # .to(), .float(): buffers become new tensors
        super()._apply(fn, recurse)
        self.step_tensors = step_tensors(self)
        return self


def step_tensors(model):
    """decode_step's 12 tensors a layer, gathered once (through the modules' attributes
    this takes longer than a small model's step)."""
    tensors = []
    for block in model.layers:
        attention, mlp = block.self_attn, block.mlp
        tensors += [block.input_layernorm.weight,
                    attention.qkv.packed, attention.qkv.gammas,
                    norm_weight(attention.attn_sub_norm),
                    attention.o_proj.weight, attention.o_proj.weight_scale,
                    block.post_attention_layernorm.weight,
                    mlp.gate_up.packed, mlp.gate_up.gammas,
                    norm_weight(mlp.ffn_sub_norm),
                    mlp.down_proj.weight, mlp.down_proj.weight_scale]
    return tensors


NO_TENSOR = torch.empty(0)


def norm_weight(norm):
    """An RMSNorm's gains, or no tensor for an Identity slot (a plain Llama's sub norms)."""
    return NO_TENSOR if isinstance(norm, nn.Identity) else norm.weight


def decodes_in_cpp(model):
    """Whether a fused model's one-token step is kernels.decode_step's: dense blocks, q/k/v
    and gate/up fused, o_proj and down_proj plain packed layers, no q/k norms, each sub
    norm an Identity or a SubLN at full strength, fp32 weights."""
    plain = (type(model.lm_head) is Int8Head
             and model.embed_tokens.weight.dtype == torch.float32)
    for block in model.layers:
        attention, mlp = block.self_attn, block.mlp
        plain = plain and (type(attention) is FusedAttention and type(mlp) is FusedMLP
                           and isinstance(attention.q_norm, nn.Identity)
                           and plain_layer(attention.o_proj) and plain_layer(mlp.down_proj)
                           and full_norm(attention.attn_sub_norm)
                           and full_norm(mlp.ffn_sub_norm))
    return plain


def plain_layer(layer):
    return (type(layer) is PackedBitLinear and layer.bias is None and layer.lrc_u is None
            and layer.rms_norm is None)


def full_norm(norm):
    return isinstance(norm, nn.Identity) or getattr(norm, 'full', True)


def fused_group(parts):
    """One FusedLinear of plain packed layers (no bias, correction or input norm; LoRA
    leaves its wrapped layers apart), or None; the layers' weights become views of its
    matrix, the same bytes."""
    plain = [type(p) is PackedBitLinear and p.bias is None and p.lrc_u is None
             and p.rms_norm is None for p in parts]
    if not all(plain):
        return None
    w = torch.cat([p.weight for p in parts])
    rows = [p.out_features for p in parts]
    # one gamma per row (or per row and block) for the fused matrix
    gammas = torch.cat([p.weight_scale.expand(n, *p.weight_scale.shape[1:])
                        for p, n in zip(parts, rows)])
    for p, view in zip(parts, w.split(rows)):
        p.register_buffer('weight', view)  # the same bytes, now inside w
    return FusedLinear(w, gammas, rows)


@torch.no_grad()
def fuse(model):
    """Faster decode, after freeze(), for inference only. Each group of packed matrices
    that reads one input (q/k/v, gate/up) becomes one matrix with a gamma per row: each
    Attention a FusedAttention, each MLP a FusedMLP (the same modules and weights, their
    class swapped); the head an Int8Head. Checkpoints do not change: fused matrices are
    views of the same bytes, the int8 head a copy."""
    for module in list(model.layers.modules()):  # each block's MLP, or each expert's
        if isinstance(module, Attention):
            fused = fused_group([module.q_proj, module.k_proj, module.v_proj])
            if fused:
                module.add_module('qkv', fused)
                module.__class__ = FusedAttention
        elif isinstance(module, MLP):
            fused = fused_group([module.gate_proj, module.up_proj])
            if fused:
                module.add_module('gate_up', fused)
                module.__class__ = FusedMLP
    head = model.lm_head
    w8, scale = pack_int8(head.weight)
    head.register_buffer('int8_weight', w8, persistent=False)
    head.register_buffer('int8_weight_scale', scale, persistent=False)
    head.__class__ = Int8Head
    if type(model) is Transformer and decodes_in_cpp(model):
        model.__class__ = FusedTransformer
        model.step_tensors = step_tensors(model)
        model.step_times = NO_TENSOR  # bench.py's profile: float64 (4,) the step adds to
    return model


def weight_bytes(model):
    """The bytes of what a forward reads: parameters, packed weights and their scales,
    and the int8 head of fuse()."""
    weights = dict(model.named_parameters())
    for name, b in model.named_buffers():
        if name.endswith(('weight', 'weight_scale')):
            weights[name] = b
    return sum(t.nbytes for t in weights.values())


def profile_token(model, x, new):
    """Where a decode token's time goes: ms per token in the LM head, the packed projections
    (kernels.py), attention (each Attention's call but its projections: q/k norms, RoPE,
    the cache and SDPA) and the rest (the norms, the MLPs' activations, residuals, Python),
    timing each call during one greedy generate of `new` tokens from x, through forward
    hooks, all removed afterwards."""
    ms = dict.fromkeys(('head', 'projections', 'attention'), 0.0)
    started = {}

    def before(module, args):
        started[module] = time.perf_counter()

    def after(part):
        def hook(module, args, y):
            ms[part] += (time.perf_counter() - started.pop(module)) * 1e3
        return hook

    def attention_before(module, args):  # the projections' time so far, to leave out
        started[module] = time.perf_counter(), ms['projections']

    def attention_after(module, args, y):
        t0, projections = started.pop(module)
        spent = (time.perf_counter() - t0) * 1e3
        ms['attention'] += spent - (ms['projections'] - projections)
    hooks = []
    projections = (PackedBitLinear, FusedLinear)
    layers = [(m, 'projections') for m in model.modules() if isinstance(m, projections)]
    for module, part in layers + [(model.lm_head, 'head')]:
        hooks += [module.register_forward_pre_hook(before),
                  module.register_forward_hook(after(part))]
    for module in model.modules():
        if isinstance(module, Attention):
            hooks += [module.register_forward_pre_hook(attention_before),
                      module.register_forward_hook(attention_after)]
    try:
        t0 = time.perf_counter()
        generate(model, x, new, temperature=0)
        total = (time.perf_counter() - t0) * 1e3
    finally:
        for hook in hooks:
            hook.remove()
    parts = {k: v / new for k, v in ms.items()}
    return parts | {'rest': (total - sum(ms.values())) / new, 'total': total / new}
