"""Packed passes: a micro-batch's sequences end to end in one row, no padding computed.

A padded pass computes every row to its micro-batch's longest, which on an RL-shaped pass wastes a third or more of
its tokens even with rows grouped by length (``benchmarks/bench_padding.py``). A packed pass concatenates its
sequences into one stream of exactly their tokens: positions restart at each sequence's start, attention stays
within each sequence (``PACKED_ATTENTION``, one causal attention per sequence, so no stream-long mask exists), and
each token's LoRA delta comes from its own sequence's adapter (``Routing.of(..., lengths=)``). Losses and
log-probabilities are cut back per sequence from the stream; they equal the padded pass's (tests/lilo/
test_packing.py).

Layers that mix tokens some other way run once per sequence (``Family.recurrent``: linear attention's and
state-space mixers' recurrent state, DeepSeek-V4's compressed attention); GLM-5's indexer gets the stream's mask
built (``Family.packed_mask``); attention sinks count in each sequence's softmax. A family whose ``Family.packs`` is
off runs padded. Micro-batches are filled by real tokens, first fit with the longest sequences first
(``packed_bins``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "lilo_packed"
# The same, with the stream's block-diagonal causal mask built, for the layers that read the mask themselves
# (GLM-5's indexer scores every key of the row): the stream's square in booleans.
PACKED_MASKED_ATTENTION = "lilo_packed_masked"
# The keyword a packed pass gives the model, which hands it on to every attention layer: each sequence's
# (start, end) in the stream.
SEGMENTS = "lilo_segments"


def _packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each of the stream's sequences (a sliding window's band where the layer has one; the
    keys its indexer picked where it has one): SDPA per sequence, so the work is each sequence's own, not the
    stream's square. Returns (1, tokens, heads, dim) as transformers' attention functions do."""
    segments = kwargs.pop(SEGMENTS, None)
    if segments is None:
        raise RuntimeError(f"The {PACKED_ATTENTION!r} attention needs the sequences' bounds ({SEGMENTS}=...); this "
                           "layer's model did not pass its keywords on to its attention, so it cannot run packed.")
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks: a logit per head that takes a share of the softmax
    picked = kwargs.get("indices")  # GLM-5's sparse attention: the keys (of the stream) each query attends to
    tokens = query.shape[2]
    extra = key.shape[2] > tokens  # keys past the stream's (DeepSeek-V4's compressed ones): each sequence's too
    outputs = []
    for start, end in segments:
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        if extra:
            k, v = (torch.cat([part, t[:, :, tokens:]], dim=2) for part, t in ((k, key), (v, value)))
        mask = None
        if attention_mask is not None:
            rows = attention_mask[:, :, start:end]
            mask = torch.cat([rows[..., start:end], rows[..., tokens:]], dim=-1) if extra else rows[..., start:end]
            if picked is not None:
                chosen = torch.zeros(end - start, query.shape[2], dtype=torch.bool, device=query.device)
                mask = mask & chosen.scatter_(-1, picked[0, start:end].long(), True)[:, start:end]
        elif sinks is not None or (sliding_window is not None and end - start > sliding_window):
            mask = _band(end - start, sliding_window, query.device)
        if sinks is not None:
            outputs.append(_with_sinks(q, k, v, mask, sinks, scaling if scaling is not None else q.shape[-1] ** -0.5))
            continue
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=True)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                sinks: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention whose softmax also counts a sink logit per head (whose value is zero), as GPT-OSS's and DeepSeek-V4's:
    (1, tokens, heads, dim). ``mask``: which keys each query sees, or an additive mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = query @ key.transpose(2, 3) * scaling
    logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    logits = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1).to(logits.dtype)], dim=-1)
    weights = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return (weights.to(value.dtype) @ value).transpose(1, 2)


def _no_mask(*args, **kwargs) -> None:
    """A packed pass's mask: none (its attention bounds each sequence itself)."""
    return None


AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)
AttentionInterface.register(PACKED_MASKED_ATTENTION, _packed_attention)
AttentionMaskInterface.register(PACKED_MASKED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def packed_attention(decoder: nn.Module, recurrent: Sequence[str] = (), masked: bool = False) -> Iterator[None]:
    """Within the block (and the backward passes of what it computes), ``decoder``'s attention layers run packed
    (its configuration says which attention its layers run, and they read it on every call; ``masked``: with the
    stream's mask built), and each module named in ``recurrent`` once per sequence."""
    config = decoder.config
    before = config._attn_implementation
    config._attn_implementation = PACKED_MASKED_ATTENTION if masked else PACKED_ATTENTION
    modules = [module for path, module in decoder.named_modules()
               if path.rsplit(".", 1)[-1] in recurrent or type(module).__name__ in recurrent]
    for module in modules:
        # An instance attribute shadows the class's forward, which nn.Module.__call__ looks up on the instance.
        module.forward = functools.partial(_per_sequence, module)
    try:
        yield
    finally:
        config._attn_implementation = before
        for module in modules:
            del module.forward


def _per_sequence(module: nn.Module, *args, **kwargs) -> Any:
    """``module`` (one that mixes tokens other than by attention over the stream: a recurrent mixer, DeepSeek-V4's
    compressed attention) on each sequence of the stream alone, as a padded row runs it: its outputs end to end, its
    per-token inputs (positions, rotary tables) cut to the sequence, its LoRA layers routed by the sequence's own
    tokens. A recurrent mixer starts from a fresh state and takes no mask (a packed stream has no padding); an
    attention module (one with a ``sliding_window``) takes its sequence's causal mask."""
    forward = type(module).forward.__get__(module)
    segments = kwargs.get(SEGMENTS)
    if segments is None:
        return forward(*args, **kwargs)
    if "hidden_states" in kwargs:
        hidden, rest = kwargs.pop("hidden_states"), args
    else:
        hidden, rest = args[0], args[1:]
    tokens = hidden.shape[1]
    routed = [(layer, layer.routing) for layer in module.modules() if getattr(layer, "routing", None) is not None]
    outputs = []
    try:
        for start, end in segments:
            for layer, routing in routed:
                layer.routing = routing.window(start, end)
            cut = {key: _cut(value, tokens, start, end) for key, value in kwargs.items()}
            cut[SEGMENTS] = ((0, end - start),)
            cut["attention_mask"] = (_causal_mask(end - start, module.sliding_window, hidden)
                                     if hasattr(module, "sliding_window") else None)
            outputs.append(forward(hidden[:, start:end], *rest, **cut))
    finally:
        for layer, routing in routed:
            layer.routing = routing
    if isinstance(outputs[0], tuple):  # (output, attention weights): no weights are kept
        return torch.cat([output[0] for output in outputs], dim=1), None
    return torch.cat(outputs, dim=1)


def _cut(value: Any, tokens: int, start: int, end: int) -> Any:
    """``value`` cut to tokens ``start`` to ``end`` where it holds one entry a token of the stream (along its second
    axis, as positions and rotary tables do; in tuples and dicts of them)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens:
        return value[:, start:end]
    if isinstance(value, tuple):
        return tuple(_cut(item, tokens, start, end) for item in value)
    if isinstance(value, dict):
        return {key: _cut(item, tokens, start, end) for key, item in value.items()}
    return value


def _band(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Which keys each query of one sequence sees (1, 1, length, length): the causal ones, within ``window`` tokens
    where given."""
    position = torch.arange(length, device=device)
    offset = position[:, None] - position[None, :]
    return ((offset >= 0) & (offset < (window or length)))[None, None]


def _causal_mask(length: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    """``_band`` as an additive mask in ``like``'s dtype."""
    seen = _band(length, window, like.device)
    return torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill(~seen, torch.finfo(like.dtype).min)


def packed_stream(sequences: Sequence[Sequence[int] | np.ndarray]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               tuple[tuple[int, int], ...]]:
    """(token ids (1, tokens), positions (1, tokens), each sequence's (start, end)) of ``sequences`` end to end."""
    arrays = [np.asarray(sequence, dtype=np.int64) for sequence in sequences]
    ends = np.cumsum([len(a) for a in arrays]).tolist()
    segments = tuple(zip([0, *ends[:-1]], ends))
    ids = torch.from_numpy(np.concatenate(arrays))[None]
    positions = torch.from_numpy(np.concatenate([np.arange(len(a)) for a in arrays]))[None]
    return ids, positions, segments


def packed_targets(targets: Sequence[Sequence[int] | np.ndarray]) -> torch.Tensor:
    """(1, tokens, K) target ids of ``targets`` end to end, K the most any sequence has per position (1 for one
    target a token), zero-padded along K."""
    arrays = [np.asarray(t, dtype=np.int64).reshape(len(t), -1) for t in targets]
    width = max(a.shape[1] for a in arrays)
    padded = [np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays]
    return torch.from_numpy(np.concatenate(padded))[None]


def packed_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``budget`` tokens each (a longer one alone in its own): first fit,
    longest first, which leaves few bins part-empty. Each bin lists its indices in ascending order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((b for b, free in enumerate(room) if free >= lengths[index]), None)
        if fit is None:
            bins.append([])
            room.append(budget)
            fit = len(bins) - 1
        bins[fit].append(index)
        room[fit] -= lengths[index]
    return [sorted(b) for b in bins]
