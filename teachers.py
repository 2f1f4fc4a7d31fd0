"""
The teachers that distillation learns from, each called as teacher(x, y, ...) and answering
with a dict (objectives.py reads it):
- `LocalTeacher`   a frozen model (the fp original, most often) on its own device and dtype:
                   its logits, and the features objectives ask for (every block's output,
                   each block's input, one block's q, k, v)
- `BaseTeacher`    a LoRA student's own frozen base, its adapters switched off (the
                   reference of DPO and GRPO), so that the model is held once
- `RemoteTeacher`  a vLLM server (OpenAI-compatible API): the top-k logprobs of every
                   position, for logits distillation from a model too big to hold here

This file needs torch, requests and objectives.py (whose run_model calls a model).
"""
import time

import requests
import torch

from objectives import run_model


class LocalTeacher:
    """A frozen model on its own device and dtype: eval mode, no gradients."""
    local = True  # gives features, not only logits

    def __init__(self, model, device='cpu', dtype=torch.float32):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device = device
        self.n_layer = len(model.layers)

    @torch.no_grad()
    def __call__(self, x, y, hidden=False, qkv_layer=None, valid=None, inputs=False):
        """{'logits'}, plus 'hidden' (every block's output), 'qkv' (one block's) and
        'inputs' (every block's input: the embeddings, then each block's output but the
        last one's) when asked for."""
        here = x.to(self.device)
        out = run_model(self.model, here, hidden or inputs, qkv_layer, valid)
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
    send the targets' last token too, so every student position gets its entry."""
    local = False  # logprobs only

    def __init__(self, url, model, top_k=20, timeout=60.0, retries=3, backoff=1.0):
        self.url = url.rstrip('/') + '/v1/completions'
        self.model, self.top_k = model, top_k
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.n_layer = None

    def post(self, ids):
        body = {'model': self.model, 'prompt': ids, 'max_tokens': 1, 'temperature': 0,
                'prompt_logprobs': self.top_k}
        for attempt in range(self.retries + 1):
            try:
                r = requests.post(self.url, json=body, timeout=self.timeout)
                r.raise_for_status()
                entries = r.json()['choices'][0]['prompt_logprobs']
                if len(entries) != len(ids):
                    raise ValueError(f"{len(entries)} prompt_logprobs "
                                     f"for {len(ids)} tokens")
                return entries
            except (requests.RequestException, ValueError, KeyError, IndexError,
                    TypeError) as e:
                error = e
                if attempt < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
        raise RuntimeError(f"teacher server {self.url} failed after {self.retries + 1} "
                           f"tries ({error}); check that vLLM serves {self.model!r} "
                           f"there, with --max-logprobs >= {self.top_k}")

    def __call__(self, x, y, hidden=False, qkv_layer=None):
        """Top-k logprobs only
        (the manager refuses objectives that want features from a server)."""
        B, T = x.shape
        ids = torch.zeros(B, T, self.top_k, dtype=torch.long)
        logprobs = torch.full((B, T, self.top_k), -float('inf'))
        seqs = torch.cat((x, y[:, -1:].clamp(min=0)), dim=1).tolist()
        for b, seq in enumerate(seqs):
            # entry i + 1 -> student position i
            for i, entry in enumerate(self.post(seq)[1:]):
                ranked = sorted(entry.items(), key=lambda kv: -kv[1]['logprob'])
                top = ranked[:self.top_k]
                ids[b, i, :len(top)] = torch.tensor([int(k) for k, _ in top])
                logprobs[b, i, :len(top)] = torch.tensor([v['logprob'] for _, v in top])
        return {'topk_ids': ids.to(x.device), 'topk_logprobs': logprobs.to(x.device)}
