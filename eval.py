"""
Evaluation: how well a model predicts text it never trained on.

- Held-out loss: the mean next-token cross-entropy over the counted targets, in nats
  per token. train.py's val loss is this, on the same batches at every evaluation.
- Bits per byte: the summed loss over a text, in bits, divided by the text's length in
  UTF-8 bytes. Nats per token depend on the tokenizer (bigger tokens make fewer, harder
  predictions); bits per byte do not, so models with other tokenizers compare.

This file needs only torch and a model that maps token ids (B, T) to logits.
"""
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

IGNORE = -100  # a target that does not count, as in objectives.py and data.py


@torch.no_grad()
def loss_sums(model, batches, ctx=nullcontext(), progress=None):
    """[summed cross-entropy, counted targets] over a list of batches ({'x', 'y'}) as one
    tensor, so that ranks can add theirs in one all-reduce before dividing. After each
    batch, progress(batches done, last=...) if given (a hub.Progress)."""
    sums = torch.zeros(2, device=next(model.parameters()).device)
    for i, b in enumerate(batches):
        with ctx:
            logits = model(b['x'])
            loss = F.cross_entropy(logits.float().flatten(0, 1), b['y'].flatten(),
                                   ignore_index=IGNORE, reduction='sum')
            counted = (b['y'] != IGNORE).sum()
            sums += torch.stack([loss, counted])
        if progress:
            progress(i + 1, last=i + 1 == len(batches))
    return sums


@torch.no_grad()
def heldout(model, tokens, enc, T=512):
    """{'nats': per token, 'bpb': bits per byte} of a held-out token array, in windows
    of T tokens (each window predicts its own tokens from its first on)."""
    nats = 0.0
    nbytes = 0
    for i in range(0, len(tokens) - 1, T):
        x = torch.from_numpy(tokens[i:i + T + 1].astype('int64'))[None]
        logits = model(x[:, :-1])[0].float()
        nats += F.cross_entropy(logits, x[0, 1:], reduction='sum').item()
        nbytes += sum(len(enc.decode_single_token_bytes(t)) for t in x[0, 1:].tolist())
    return dict(nats=nats / (len(tokens) - 1), bpb=nats / math.log(2) / nbytes)
