"""Activation checkpointing of a model's decoder layers, for one pass: each layer keeps only its input for the
backward pass, which runs the layer's forward again to get the rest. One more forward of compute; in memory a
layer's input a token instead of all it computes (``batch_tokens.recompute_bytes_per_token``). The trainer turns
it on for a sequence longer than its pass budget, which otherwise could not run at all."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def recomputed_layers(layers: Sequence[nn.Module], enabled: bool = True) -> Iterator[None]:
    """Within the block (and the backward passes of what it computes), ``layers`` run checkpointed when
    ``enabled``. Randomness is none to replay: the base model is in eval mode (no dropout)."""
    if not enabled:
        yield
        return
    for layer in layers:
        # An instance attribute shadows the class's forward, which nn.Module.__call__ looks up on the instance.
        layer.forward = functools.partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
