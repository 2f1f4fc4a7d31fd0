"""Every objective against an independent computation, the curriculum, and the teachers."""
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.nn.functional as F

from bitlinear import BitLinear
from model import ModelConfig, Transformer
from objectives import (DPO, IGNORE, AttentionRelationKD, BlockReconstruction, CrossEntropy, CurriculumScheduler,
                        HiddenStateKD, LogitsKD, LRCReconstruction, MaskedDiffusion, ObjectiveManager, ce_loss,
                        depth_map, dpo_loss, relations)
from teachers import LocalTeacher, RemoteTeacher


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=48, max_seq_len=64)
    return Transformer(ModelConfig(**{**cfg, **kw}))


def test_kd_is_t_squared_forward_kl():
    torch.manual_seed(0)
    z_s, z_t = torch.randn(1, 3, 5), torch.randn(1, 3, 5)
    y = torch.tensor([[1, IGNORE, 2]])
    T = 2.0
    expected = 0.0
    for i in (0, 2):  # the IGNOREd position does not count
        p_t = [math.exp(v / T) for v in z_t[0, i].tolist()]
        p_s = [math.exp(v / T) for v in z_s[0, i].tolist()]
        p_t, p_s = [p / sum(p_t) for p in p_t], [p / sum(p_s) for p in p_s]
        expected += T * T * sum(a * (math.log(a) - math.log(b)) for a, b in zip(p_t, p_s))
    got = LogitsKD(temperature=T).loss({'y': y}, {'logits': z_s}, {'logits': z_t})
    assert abs(got.item() - expected / 2) < 1e-5


def test_sparse_kd_equals_dense_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    z_s, z_t, y = torch.randn(2, 4, 7), torch.randn(2, 4, 7), torch.randint(7, (2, 4))
    logprobs, ids = F.log_softmax(z_t, -1).sort(-1, descending=True)  # what a server sends: raw logprobs
    kd = LogitsKD(temperature=5.0)
    dense = kd.loss({'y': y}, {'logits': z_s}, {'logits': z_t})
    sparse = kd.loss({'y': y}, {'logits': z_s}, {'topk_logprobs': logprobs, 'topk_ids': ids})
    assert abs(dense.item() - sparse.item()) < 1e-5 and dense.item() > 0


def test_sparse_kd_with_fewer_than_k_logprobs_is_finite_and_exact():
    """A server may send fewer than k logprobs at a position (-inf padding): those slots count for nothing."""
    torch.manual_seed(0)
    z_s, y = torch.randn(1, 2, 9, requires_grad=True), torch.randint(9, (1, 2))
    ids = torch.tensor([[[3, 1, 7, 0], [5, 2, 0, 0]]])
    logprobs = torch.tensor([[[-0.5, -1.5, -2.5, -float('inf')], [-0.2, -1.9, -float('inf'), -float('inf')]]])
    T = 2.0
    loss = LogitsKD(temperature=T).loss({'y': y}, {'logits': z_s}, {'topk_logprobs': logprobs, 'topk_ids': ids})
    loss.backward()
    expected = 0.0
    for pos, n in ((0, 3), (1, 2)):  # by hand, over the valid entries only
        lt = torch.log_softmax(logprobs[0, pos, :n] / T, -1)
        ls = torch.log_softmax(z_s[0, pos].detach() / T, -1)[ids[0, pos, :n]]
        expected += T * T * (lt.exp() * (lt - ls)).sum().item() / 2
    assert abs(loss.item() - expected) < 1e-5 and torch.isfinite(z_s.grad).all()


def test_attention_relation_kd_formula_with_gqa_widths():
    torch.manual_seed(0)
    B, T, r = 2, 5, 2
    s = [torch.randn(B, T, 8), torch.randn(B, T, 4), torch.randn(B, T, 4)]    # student: GQA, K/V narrower
    t = [torch.randn(B, T, 12), torch.randn(B, T, 6), torch.randn(B, T, 6)]   # teacher: other widths
    for normalize in (False, True):
        expected = 0.0
        for a_s, a_t in zip(s, t):
            kl = 0.0
            for b in range(B):
                for h in range(r):
                    def rel(a):
                        d = a.shape[-1] // r
                        part = a[b, :, h * d:(h + 1) * d]
                        if normalize:
                            part = part / part.norm(dim=-1, keepdim=True)
                            return torch.softmax(part @ part.T, -1)
                        return torch.softmax(part @ part.T / math.sqrt(d), -1)
                    R_s, R_t = rel(a_s), rel(a_t)
                    kl += (R_t * (R_t.log() - R_s.log())).sum()
            expected += kl / (B * r * T)
        obj = AttentionRelationKD(heads=r, normalize=normalize)
        got = obj.loss({}, {'qkv': s}, {'qkv': t})
        assert abs(got.item() - expected.item()) < 1e-5
    with pytest.raises(ValueError, match='must divide the width'):
        relations(torch.randn(1, 2, 6), 4, False)


def test_hidden_state_kd_and_depth_map():
    assert depth_map(2, 4) == [1, 3] and depth_map(3, 3) == [0, 1, 2] and depth_map(4, 2) == [0, 0, 1, 1]
    torch.manual_seed(0)
    hs = [torch.randn(1, 3, 4) for _ in range(2)]
    ht = [torch.randn(1, 3, 4) for _ in range(4)]
    expected = sum(((a / a.norm(dim=-1, keepdim=True) - b / b.norm(dim=-1, keepdim=True)) ** 2).mean()
                   for a, b in zip(hs, [ht[1], ht[3]])) / 2
    assert abs(HiddenStateKD().loss({}, {'hidden': hs}, {'hidden': ht}).item() - expected.item()) < 1e-6


class Recorder(torch.nn.Module):
    """A stand-in model: remembers its inputs and returns fixed logits."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.calls = logits, []

    def forward(self, x, causal=True, **_):
        self.calls.append((x.clone(), causal))
        return self.logits


def test_diffusion_weights_by_one_over_p_and_never_masks_the_prompt():
    B, T, V, mask_id = 3, 12, 9, 8
    x = torch.randint(0, 8, (B, T), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    y[:, :4] = IGNORE                      # a 5-token prompt: x[0..4] is the condition
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1))
    model = Recorder(logits)
    torch.manual_seed(7)
    got = MaskedDiffusion(mask_id).run(model, None, {'x': x, 'y': y})
    torch.manual_seed(7)                   # replay the two draws: t per sequence, then u per token
    p = (1 - 1e-3) * torch.rand(B, 1) + 1e-3
    u = torch.rand(B, T)
    seen, causal = model.calls[0]
    assert causal is False                 # bidirectional attention for the denoiser
    assert (seen[:, :5] == x[:, :5]).all()  # the prompt (and the first token) stay visible
    expected, counted = 0.0, 0
    for b in range(B):
        for i in range(5, T):              # the answer tokens x[5..T-1] count
            counted += 1
            if u[b, i] < p[b, 0]:
                assert seen[b, i] == mask_id
                expected += -F.log_softmax(logits[b, i - 1], -1)[x[b, i]].item() / p[b, 0].item()
            else:
                assert seen[b, i] == x[b, i]
    assert abs(got.item() - expected / counted) < 1e-4 and expected > 0


def test_dpo_closed_form():
    # beta * ((-1 - -1.5) - (-2 - -1.5)) = 0.1 * 1.0, and -log sigmoid(0.1) = log(1 + e^-0.1)
    got = dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]), 0.1)
    assert abs(got.item() - math.log(1 + math.exp(-0.1))) < 1e-6
    # the objective sums log-probs over answer tokens only
    V = 5
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    x = torch.zeros(1, 3, dtype=torch.long)
    y_w, y_l = torch.tensor([[IGNORE, 1, 2]]), torch.tensor([[IGNORE, 3, 3]])
    lp = F.log_softmax(logits, -1)
    pi_w, pi_l = lp[0, 1, 1] + lp[0, 2, 2], lp[1, 1, 3] + lp[1, 2, 3]
    ref_logits = torch.zeros(2, 3, V)       # a uniform reference: log(1/5) per token
    teacher = lambda x, y: {'logits': ref_logits}
    got = DPO(beta=0.5).run(Recorder(logits), teacher, {'pairs': (x, y_w, x, y_l)})
    ref = 2 * math.log(1 / V)
    assert abs(got.item() + F.logsigmoid(0.5 * ((pi_w - ref) - (pi_l - ref))).item()) < 1e-5


@pytest.mark.parametrize('name', ['ce', 'kd', 'attn', 'hidden', 'lrc', 'block', 'diffusion', 'dpo'])
def test_gradients_reach_the_student_and_never_the_teacher(name):
    student = tiny(bitnet=True).add_lrc(2) if name == 'lrc' else tiny(bitnet=True)
    teacher = LocalTeacher(tiny(seed=1))
    obj = {'ce': CrossEntropy(), 'kd': LogitsKD(), 'attn': AttentionRelationKD(layer=1, heads=2), 'hidden': HiddenStateKD(),
           'lrc': LRCReconstruction(), 'block': BlockReconstruction(), 'diffusion': MaskedDiffusion(mask_id=39),
           'dpo': DPO()}[name]
    manager = ObjectiveManager({name: obj}, CurriculumScheduler([(1.0, {name: 1.0})]), teacher, n_layer=2)
    x = torch.randint(39, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    pairs = (x, y, x.flip(0), y.flip(0))
    loss, metrics = manager(student, {'x': x, 'y': y, 'pairs': pairs}, 0.5)
    loss.backward()
    assert metrics[f'loss_{name}'].item() > 0 and metrics[f'w_{name}'] == 1.0
    should = {n for n, p in student.named_parameters()}
    if name in ('lrc', 'hidden'):  # block outputs: the final norm and the head are not involved
        should = {n for n in should if not n.startswith(('lm_head', 'norm'))}
    if name == 'attn':  # the relations at layer 1 depend on nothing after its q/k/v projections
        should = {n for n in should if n.startswith(('embed_tokens', 'layers.0.', 'layers.1.input_layernorm',
                                                    'layers.1.self_attn.q_proj', 'layers.1.self_attn.k_proj',
                                                    'layers.1.self_attn.v_proj'))}
    if name == 'block':  # teacher-forced blocks: the embeddings, final norm and head are not involved
        should = {n for n in should if n.startswith('layers.')}
        assert all(p.grad is None for n, p in student.named_parameters() if n not in should)
    for n, p in student.named_parameters():
        if n in should:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    if name == 'lrc':
        assert all(m.lrc_u.grad.abs().sum() > 0 and m.lrc_v.grad.abs().sum() > 0
                   for m in student.modules() if isinstance(m, BitLinear))
    assert all(p.grad is None and not p.requires_grad for p in teacher.model.parameters())


def test_block_reconstruction_feeds_each_block_the_teachers_input():
    """Computed block by block by hand: the teacher's embeddings go through its blocks; each student block
    gets the same input, and its MSE to the teacher block's output is divided by the mean square of what
    the teacher block added."""
    fp, student = tiny(seed=1), tiny(seed=2, bitnet=True)
    x = torch.randint(39, (2, 16), generator=torch.Generator().manual_seed(0))
    cos, sin = fp.cos[:16], fp.sin[:16]
    h, expected = fp.embed_tokens(x), []
    with torch.no_grad():
        for t_block, s_block in zip(fp.layers, student.layers):
            out, mine = t_block(h, cos, sin), s_block(h, cos, sin)
            expected.append(((mine - out) ** 2).mean() / ((out - h) ** 2).mean())
            h = out
    got = BlockReconstruction().run(student, LocalTeacher(fp), {'x': x, 'y': x})
    assert abs(got.item() - sum(expected).item() / 2) < 1e-5 * got.item()
    assert got.item() > 0.01
    # a student equal to the teacher has nothing to learn, whatever its blocks' errors would compound to
    assert BlockReconstruction().run(tiny(seed=1), LocalTeacher(tiny(seed=1)), {'x': x, 'y': x}).item() == 0
    with pytest.raises(ValueError, match="block needs a teacher of the student's depth"):
        ObjectiveManager({'block': BlockReconstruction()}, CurriculumScheduler([(1.0, {'block': 1.0})]),
                         LocalTeacher(tiny(n_layer=3)), n_layer=2)


def test_lrc_starts_from_the_svd_of_the_quantization_residual():
    from bitlinear import weight_quant
    model = tiny(bitnet=True)
    layer = model.layers[0].mlp.up_proj
    w_q, gamma = weight_quant(layer.weight)
    residual = layer.weight.detach() - gamma * w_q
    model.add_lrc(48)  # full rank: the correction is the whole residual
    assert torch.allclose(layer.lrc_u @ layer.lrc_v, residual, atol=1e-5)
    assert layer.lrc_u.abs().sum() > 0 and layer.lrc_v.abs().sum() > 0


def test_curriculum_boundaries_and_blends():
    phases = [(0.3, {'ce': 1.0}), (0.7, {'ce': 1.0, 'kd': 10.0}), (1.0, {'kd': 2.0})]
    sw = CurriculumScheduler(phases)
    assert sw.weights(0.0) == {'ce': 1.0, 'kd': 0.0}
    assert sw.weights(0.2999) == {'ce': 1.0, 'kd': 0.0}
    assert sw.weights(0.3) == {'ce': 1.0, 'kd': 10.0}
    assert sw.weights(0.6999) == {'ce': 1.0, 'kd': 10.0}
    assert sw.weights(0.7) == {'ce': 0.0, 'kd': 2.0} == sw.weights(1.0)
    lin = CurriculumScheduler(phases, 'linear')
    assert lin.weights(0.0) == {'ce': 1.0, 'kd': 0.0}
    assert lin.weights(0.15) == pytest.approx({'ce': 1.0, 'kd': 5.0})       # halfway through phase 1
    assert lin.weights(0.3) == pytest.approx({'ce': 1.0, 'kd': 10.0})       # continuous at the boundary
    assert lin.weights(0.5) == pytest.approx({'ce': 0.5, 'kd': 6.0})
    cos = CurriculumScheduler(phases, 'cosine')
    assert cos.weights(0.075) == pytest.approx({'ce': 1.0, 'kd': 10 * (0.5 - 0.5 * math.cos(math.pi / 4))})
    with pytest.raises(ValueError, match='must increase'):
        CurriculumScheduler([(0.5, {'ce': 1.0}), (0.4, {'ce': 1.0})])


class Counting(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *a, **kw):
        self.calls += 1
        return self.model(*a, **kw)


def test_objectives_at_weight_zero_cost_nothing():
    student, teacher = Counting(tiny()), LocalTeacher(tiny(seed=1))
    teacher.model = teacher_model = Counting(teacher.model)
    objs = {'ce': CrossEntropy(), 'kd': LogitsKD(), 'diffusion': MaskedDiffusion(mask_id=39)}
    manager = ObjectiveManager(objs, CurriculumScheduler([(0.5, {'ce': 1.0}), (1.0, {'ce': 1.0, 'kd': 1.0})]),
                               teacher, n_layer=2)
    x = torch.randint(39, (1, 8))
    _, metrics = manager(student, {'x': x, 'y': x}, 0.25)
    assert student.calls == 1 and teacher_model.calls == 0 and set(metrics) == {'loss_ce', 'w_ce', 'w_kd'}
    _, metrics = manager(student, {'x': x, 'y': x}, 0.75)   # kd joins: the student forward is shared
    assert student.calls == 2 and teacher_model.calls == 1 and 'loss_kd' in metrics


def test_the_head_runs_only_where_a_loss_reads_it():
    """CE + KD + attention: the head of student and teacher makes only the counted targets' logits, and the
    losses and every gradient equal those of the full logits masked by hand; block-wise reconstruction and
    attention alone make none."""
    student, fp = tiny(bitnet=True), tiny(seed=1)
    rows = []
    for model in (student, fp):
        model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    x = torch.randint(39, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    y[:, :5] = IGNORE  # a prompt
    y[1, 9] = IGNORE
    counted = y != IGNORE
    T = 2.0
    objs = {'ce': CrossEntropy(), 'kd': LogitsKD(temperature=T), 'attn': AttentionRelationKD(layer=1, heads=2)}
    weights = {'ce': 1.0, 'kd': 0.5, 'attn': 2.0}
    manager = ObjectiveManager(objs, CurriculumScheduler([(1.0, weights)]), LocalTeacher(fp), n_layer=2)
    loss, metrics = manager(student, {'x': x, 'y': y}, 0.5)
    loss.backward()
    assert rows == [counted.sum().item()] * 2 == [21, 21]
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    s_feats, t_feats = {'qkv': [], 'qkv_layer': 1}, {'qkv': [], 'qkv_layer': 1}
    z_s = student(x, feats=s_feats)
    with torch.no_grad():
        z_t = fp(x, feats=t_feats)
    ce = F.cross_entropy(z_s.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    log_ps, log_pt = F.log_softmax(z_s / T, -1), F.log_softmax(z_t / T, -1)
    kd = (T * T * (log_pt.exp() * (log_pt - log_ps)).sum(-1))[counted].mean()
    attn = objs['attn'].loss({}, s_feats, t_feats)
    torch.testing.assert_close(metrics['loss_ce'], ce.detach())
    torch.testing.assert_close(metrics['loss_kd'], kd.detach())
    by_hand = ce + 0.5 * kd + 2.0 * attn
    torch.testing.assert_close(loss, by_hand)
    by_hand.backward()
    for n, p in student.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)
    for name, obj in (('block', BlockReconstruction()), ('attn', AttentionRelationKD(layer=1, heads=2))):
        rows.clear()
        alone = ObjectiveManager({name: obj}, CurriculumScheduler([(1.0, {name: 1.0})]), LocalTeacher(fp), n_layer=2)
        alone(student, {'x': x, 'y': y}, 0.5)
        assert rows == [0, 0], name


# ------------------------------------------------------------------ the remote (vLLM) teacher

def vllm_server(model, delay=0.0, malformed=False):
    """A real HTTP server on 127.0.0.1 that answers POST /v1/completions like vLLM does."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
            time.sleep(delay)
            ids, k = body['prompt'], body['prompt_logprobs']
            with torch.no_grad():
                logprobs = F.log_softmax(model(torch.tensor([ids]))[0], -1)
            entries = [None]
            for i in range(1, len(ids)):  # entry i: P(token_i | tokens < i), top-k plus the actual token
                top = logprobs[i - 1].topk(k)
                chosen = {int(t): float(v) for t, v in zip(top.indices, top.values)}
                chosen.setdefault(ids[i], float(logprobs[i - 1, ids[i]]))
                order = logprobs[i - 1].argsort(descending=True).tolist()
                entries.append({str(t): {'logprob': v, 'rank': order.index(t) + 1, 'decoded_token': 'x'}
                                for t, v in chosen.items()})
            out = b'{not json' if malformed else json.dumps({'choices': [{'prompt_logprobs': entries}]}).encode()
            self.send_response(200)
            self.send_header('Content-Length', str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    server.handle_error = lambda *args: None  # a client that gave up on a slow answer is expected
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}'


def test_remote_teacher_matches_local_teacher_at_every_position():
    model = tiny(seed=3).eval()
    server, url = vllm_server(model)
    try:
        x = torch.randint(40, (2, 10), generator=torch.Generator().manual_seed(0))
        y = torch.roll(x, -1, 1)
        remote = RemoteTeacher(url, 'tiny', top_k=5)(x, y)
        local = F.log_softmax(LocalTeacher(model)(x, y)['logits'], -1).topk(5)
        assert torch.equal(remote['topk_ids'], local.indices)  # position i of both: the next token's top-5
        assert torch.allclose(remote['topk_logprobs'], local.values, atol=1e-5)
        keep = y > 20  # the remote teacher's answer at the kept positions only, as the manager asks
        kept = RemoteTeacher(url, 'tiny', top_k=5)(x, y, keep=keep)
        assert torch.equal(kept['topk_ids'], local.indices[keep]) and kept['topk_ids'].shape == (keep.sum(), 5)
    finally:
        server.shutdown()


@pytest.mark.parametrize('trouble', ['down', 'slow', 'malformed'])
def test_remote_teacher_fails_clearly_after_bounded_retries(trouble):
    model = tiny().eval()
    server, url = vllm_server(model, delay=2.0 if trouble == 'slow' else 0.0, malformed=trouble == 'malformed')
    if trouble == 'down':
        server.shutdown()
        server.server_close()
    teacher = RemoteTeacher(url, 'tiny', top_k=3, timeout=0.5, retries=2, backoff=0.05)
    t0 = time.time()
    with pytest.raises(SystemExit, match=r'error: teacher server .* failed after 3 tries .*check that vLLM serves'):
        teacher(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert time.time() - t0 < 5  # bounded: 3 tries of at most 0.5 s each, plus short backoffs
    if trouble != 'down':
        server.shutdown()


def test_ce_with_no_counted_target_is_zero_not_nan():
    """An SFT window that holds only a prompt: mean over zero targets is 0 with a zero gradient, not 0/0."""
    logits = torch.randn(2, 3, 7, requires_grad=True)
    y = torch.full((2, 3), IGNORE)
    loss = ce_loss(logits, y)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    y[0, 1], y[1, 2] = 4, 0  # two counted targets: their mean, computed by hand
    by_hand = -(F.log_softmax(logits[0, 1], -1)[4] + F.log_softmax(logits[1, 2], -1)[0]) / 2
    torch.testing.assert_close(ce_loss(logits, y), by_hand)
    torch.testing.assert_close(ce_loss(logits, y, 'sum'), 2 * by_hand)
    (3 * ce_loss(logits, y)).backward()  # the gradient it recomputes = F.cross_entropy's
    ref = logits.detach().requires_grad_()
    (3 * F.cross_entropy(ref.flatten(0, 1), y.flatten(), ignore_index=IGNORE)).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_preference_pairs_by_hand_empty_prompt_and_too_long_prompt(tmp_path):
    from data import preference_pairs
    from tokenizer import byte_encoding
    enc, eos = byte_encoding(), 256
    rows = [{'prompt': 'Hi', 'chosen': 'yes', 'rejected': 'no'}, {'prompt': '', 'chosen': 'ok', 'rejected': 'x'}]
    path = tmp_path / 'pairs.jsonl'
    path.write_text('\n'.join(json.dumps(r) for r in rows))
    x_w, y_w, x_l, y_l = preference_pairs(str(path), enc, 8, eos)
    H, i, y, e, s, o, k, n, X = (ord(c) for c in 'Hiyesokn' + 'x')
    I = IGNORE
    # eos, prompt, answer, eos; padded with eos; only the answer and its eos are counted targets
    assert x_w.tolist() == [[eos, H, i, y, e, s, eos, eos], [eos, o, k, eos, eos, eos, eos, eos]]
    assert y_w.tolist() == [[I, I, y, e, s, eos, I, I], [o, k, eos, I, I, I, I, I]]
    assert x_l.tolist() == [[eos, H, i, n, o, eos, eos, eos], [eos, X, eos, eos, eos, eos, eos, eos]]
    assert y_l.tolist() == [[I, I, n, o, eos, I, I, I], [X, eos, I, I, I, I, I, I]]
    path.write_text(json.dumps({'prompt': 'a' * 20, 'chosen': 'b', 'rejected': 'c'}))
    with pytest.raises(ValueError, match=r'line 1: a prompt of 21 tokens leaves no room for an answer in block_size=8'):
        preference_pairs(str(path), enc, 8, eos)


def test_the_manager_leaves_the_runs_settings_as_they_were():
    """The settings are saved with every checkpoint: what the manager fills in (diffusion's
    mask token, the router's top_k) goes to the objectives, not into the run's dict."""
    from objectives import ObjectiveManager
    student = Transformer(ModelConfig(vocab_size=64, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                                      intermediate_size=64, n_experts=4, top_k=2))
    settings = {'ce': {}, 'diffusion': {}}
    manager = ObjectiveManager.from_settings(settings, [(1.0, {'ce': 1.0, 'diffusion': 1.0})], 'switch',
                                             None, student, mask_id=63)
    assert settings == {'ce': {}, 'diffusion': {}}
    assert manager.objectives['diffusion'].mask_id == 63 and manager.objectives['router'].top_k == 2
