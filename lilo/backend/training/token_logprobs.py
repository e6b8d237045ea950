"""The target tokens' log-probabilities from a pass's last hidden states, a slice of tokens at a time.

A training pass needs, per position, only log p(target) (K of them for top-K cross-entropy), not the
full-vocabulary distribution; yet computing it through the model's logits keeps, for every token of the pass at
once, fp32 logits, their log-softmax and its gradient: 3 x 4 x vocab bytes a token, 590 KB for SmolLM2's 49,152
tokens, a quarter of the pass's memory. Here the unembedding runs on ``LOGIT_SLICE_TOKENS`` tokens at a time, each
slice under activation checkpointing: its logits are dropped once its log-probabilities are out and computed again
in the backward pass, one slice at a time, so a pass holds one slice's logits whatever its length. The values and
gradients are those of the whole-pass computation (each position's log-softmax depends on its own logits only).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lilo.backend.training.batch_tokens import LOGIT_SLICE_TOKENS


def target_logprobs(hidden: torch.Tensor, unembed: nn.Module, targets: torch.Tensor,
                    chunk_tokens: int = LOGIT_SLICE_TOKENS) -> torch.Tensor:
    """log p(targets) under ``unembed(hidden)``: ``hidden`` (rows, tokens, width), ``targets`` (rows, tokens, K)
    token ids; returns (rows, tokens, K) in fp32. Slices keep every row (the LoRA layers route by row) and take
    ``chunk_tokens // rows`` positions each."""
    width = max(1, chunk_tokens // max(1, hidden.shape[0]))
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, hidden.shape[1], width):
        h, t = hidden[:, start:start + width], targets[:, start:start + width]
        if checkpointed:
            parts.append(checkpoint(_slice_logprobs, unembed, h, t, start, use_reentrant=False))
        else:
            parts.append(_slice_logprobs(unembed, h, t, start))
    return torch.cat(parts, dim=1)


def _slice_logprobs(unembed: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
    routing = getattr(unembed, "routing", None)
    if routing is not None and routing.packed:  # one packed row: the slice's tokens are routed, not the pass's
        unembed.routing = routing.window(start, start + hidden.shape[1])
        try:
            logits = unembed(hidden).float()
        finally:
            unembed.routing = routing
    else:
        logits = unembed(hidden).float()
    if targets.shape[-1] == 1:  # one target a position: torch's fused log-softmax and gather, and its backward
        return -torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                  reduction="none").view(targets.shape)
    return logits.gather(-1, targets) - logits.logsumexp(-1, keepdim=True)
