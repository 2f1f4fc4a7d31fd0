"""
The teachers that distillation learns from, each called as teacher(x, y, ...) and answering
with a dict (objectives.py reads it):
- `LocalTeacher`   a frozen model (the fp original, most often) on its own device and dtype:
                   its logits, and the features objectives ask for (every block's output,
                   each block's input, one block's q, k, v)
- `BaseTeacher`    a LoRA student's own frozen base, its adapters switched off (the
                   reference of DPO and GRPO), so that the model is held once
- `RemoteTeacher`  a vLLM server (OpenAI-compatible API): the top-k logprobs of every
                   position, for logits distillation from a model too big to hold here;
                   its replies checked before use

This file needs torch, requests, objectives.py (whose run_model calls a model) and
checkpoint.py (which opens a local teacher).
"""
import json
import math
import time

import requests
import torch

from checkpoint import load
from hub import chunks, hide_credentials, seconds, within
from objectives import run_model


class LocalTeacher:
    """A frozen model on its own device and dtype: eval mode, no gradients."""
    local = True  # gives features, not only logits

    def __init__(self, model, device='cpu', dtype=torch.float32):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device = device
        self.n_layer = len(model.layers)

    @torch.no_grad()
    def __call__(self, x, y, hidden=False, qkv_layer=None, valid=None, inputs=False,
                 keep=None):
        """{'logits'} (at the `keep` positions, when given), plus 'hidden' (every block's
        output), 'qkv' (one block's) and 'inputs' (every block's input: the embeddings,
        then each block's output but the last one's) when asked for."""
        here = x.to(self.device)
        keep = None if keep is None else keep.to(self.device)
        out = run_model(self.model, here, hidden or inputs, qkv_layer, valid, keep=keep)
        if inputs:
            out['inputs'] = [self.model.embed_tokens(here)] + out['hidden'][:-1]
        back = {}
        for k, v in out.items():
            if torch.is_tensor(v):
                back[k] = v.to(x.device)
            else:
                back[k] = [t.to(x.device) for t in v]
        return back


class BaseTeacher(LocalTeacher):
    """A LoRA student's frozen base as the teacher (DPO's reference): the student itself
    with its adapters switched off by `switch(model, on)` (lora.set_adapters),
    so the model is held once."""

    def __init__(self, model, switch):
        self.model, self.switch, self.n_layer = model, switch, len(model.layers)
        self.device = next(model.parameters()).device

    def __call__(self, *args, **kw):
        self.switch(self.model, False)
        out = super().__call__(*args, **kw)
        self.switch(self.model, True)
        return out


class RemoteTeacher:
    """A vLLM server (OpenAI-compatible API). Per sequence we POST the token ids with
    prompt_logprobs=k; entry i of the answer holds the top-k of P(token_i | tokens < i),
    so student position i (which predicts token i + 1) lines up with entry i + 1. We
    send the targets' last token too, so every student position gets its entry.

    A reply is checked before use, as a wrong one would fail deep inside a training step:
    one entry per token, each holding at least k tokens (vLLM adds the actual token when
    it is not among the top k), each key a token id below vocab_size (the student's; None
    checks only that it is one) with its logprob. A bad reply is retried as a network
    error is, and after the last try ends the run in one line."""
    local = False  # logprobs only

    def __init__(self, url, model, top_k=20, timeout=60.0, retries=3, backoff=1.0,
                 vocab_size=None):
        self.url = url.rstrip('/') + '/v1/completions'
        self.model, self.top_k, self.vocab_size = model, top_k, vocab_size
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.n_layer = None

    def token(self, key):
        """An entry's key as a token id: the plain digits of an id in the vocabulary."""
        if not (key.isascii() and key.isdecimal()) or str(int(key)) != key:
            raise ValueError(f"key {key[:20]!r} is not a token id")
        if self.vocab_size is not None and int(key) >= self.vocab_size:
            raise ValueError(f"token id {key} is past the vocabulary ({self.vocab_size})")
        return int(key)

    def checked(self, entries, n):
        """The prompt_logprobs of n tokens as [(ids, logprobs)] of entries 1 to n - 1,
        each the top k, best first; a ValueError names what is wrong."""
        if not isinstance(entries, list) or len(entries) != n:
            raise ValueError(f"prompt_logprobs is not a list of {n} entries")
        answer = []
        for i, entry in enumerate(entries[1:], start=1):  # entry 0 has no context: None
            if not isinstance(entry, dict) or len(entry) < self.top_k:
                raise ValueError(f"entry {i} does not hold the top {self.top_k} tokens")
            top = []
            for key, value in entry.items():
                logprob = value.get('logprob') if isinstance(value, dict) else None
                # a real number (True is an int in Python), at most 0: a probability's
                # log; NaN fails the comparison, -inf (probability 0) is one
                number = type(logprob) in (int, float)
                if not number or not -math.inf <= logprob <= 0:
                    raise ValueError(f"entry {i}: key {key[:20]!r} has no logprob <= 0")
                top.append((logprob, self.token(key)))
            top = sorted(top, key=lambda pair: -pair[0])[:self.top_k]
            answer.append(([t for _, t in top], [lp for lp, _ in top]))
        return answer

    def reply(self, body, n):
        """The server's JSON reply to body (n tokens), read as it arrives: whole within
        `timeout` seconds (a per-read timeout alone never trips on a byte a second), and
        never past a stated cap, 256 bytes per entry of the top k (vLLM sends about 70)."""
        deadline, cap = time.monotonic() + self.timeout, 4096 + 256 * n * (self.top_k + 1)
        data = bytearray()
        # the status and headers too: a server may send them a byte at a time
        r = within(self.timeout, self.url, 'NANOBITNET_TEACHER_TIMEOUT', requests.post,
                   self.url, json=body, timeout=self.timeout, stream=True)
        with r:
            r.raise_for_status()
            for chunk in chunks(r):
                data += chunk
                if len(data) > cap:
                    raise ValueError(f"its reply runs past {cap:,} bytes")
                if time.monotonic() > deadline:
                    raise requests.Timeout(f"no whole reply in {self.timeout:.0f} s")
        return json.loads(data)

    def post(self, ids):
        body = {'model': self.model, 'prompt': ids, 'max_tokens': 1, 'temperature': 0,
                'prompt_logprobs': self.top_k}
        for attempt in range(self.retries + 1):
            try:
                reply = self.reply(body, len(ids))
                return self.checked(reply['choices'][0]['prompt_logprobs'], len(ids))
            except (requests.RequestException, TimeoutError, ValueError, KeyError,
                    IndexError, TypeError) as e:
                error = e
                if attempt < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
        tries = self.retries + 1
        message = (f"error: teacher server {self.url} failed after {tries} tries ({error}); "
                   f"check that vLLM serves {self.model!r} there, with the student's "
                   f"tokenizer and --max-logprobs >= {self.top_k}")
        raise SystemExit(hide_credentials(message))  # a password in the URL never shown

    def __call__(self, x, y, hidden=False, qkv_layer=None, keep=None):
        """Top-k logprobs only, (B, T, k) or at the `keep` positions (N, k)
        (the manager refuses objectives that want features from a server)."""
        B, T = x.shape
        ids = torch.zeros(B, T, self.top_k, dtype=torch.long)
        logprobs = torch.zeros(B, T, self.top_k)
        seqs = torch.cat((x, y[:, -1:].clamp(min=0)), dim=1).tolist()
        for b, seq in enumerate(seqs):
            # entry i + 1 -> student position i
            for i, (top_ids, top_logprobs) in enumerate(self.post(seq)):
                ids[b, i] = torch.tensor(top_ids)
                logprobs[b, i] = torch.tensor(top_logprobs)
        if keep is not None:
            ids, logprobs = ids[keep.cpu()], logprobs[keep.cpu()]
        return {'topk_ids': ids.to(x.device), 'topk_logprobs': logprobs.to(x.device)}


def from_settings(teacher, vllm, student, switch=None, device='cpu', dtype=torch.float32):
    """A run's teacher: a vLLM server for an http(s) URL (vllm: the model it serves, the
    logprobs per position), a local checkpoint or HF directory otherwise; with no
    teacher named, a LoRA student's own base when `switch` turns its adapters off, else
    None."""
    if teacher.startswith(('http://', 'https://')):
        return RemoteTeacher(teacher, vllm['model'], top_k=vllm['top_k'],
                             timeout=seconds('NANOBITNET_TEACHER_TIMEOUT', 60),
                             vocab_size=student.config.vocab_size)
    if teacher:
        try:
            model = load(teacher, packed=False)[1]
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"cannot load {teacher!r}: {e}") from None
        return LocalTeacher(model, device, dtype)
    if switch:
        return BaseTeacher(student, switch)
    return None
