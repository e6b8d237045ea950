"""Which pending requests may run now: a pure function of their metadata, never of their payloads."""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple, Sequence

# A barrier runs only once everything its model submitted before it has finished, and nothing submitted after it
# runs before it does.
BARRIER_TYPES = frozenset({"optim_step", "load_weights"})
# Sampling reads published weights, not the training state, so barriers do not hold it back.
BARRIER_FREE_TYPES = frozenset({"sample"})


class PendingMeta(NamedTuple):
    request_id: int
    model_id: str
    request_type: str
    seq_id: int | None


def _order(meta: PendingMeta) -> tuple:
    return (meta.model_id, meta.seq_id if meta.seq_id is not None else -1, meta.request_id)


def dispatchable(pending: Sequence[PendingMeta]) -> list[PendingMeta]:
    """The requests that may run now, per model in seq order: everything before the model's first pending barrier,
    or the barrier itself when nothing is pending before it; samples always."""
    ready: list[PendingMeta] = []
    for _model, requests in groupby(sorted(pending, key=_order), key=lambda meta: meta.model_id):
        first, blocked = True, False
        for meta in requests:
            if meta.request_type in BARRIER_FREE_TYPES:
                ready.append(meta)
            elif not blocked:
                if meta.request_type not in BARRIER_TYPES or first:
                    ready.append(meta)
                blocked = meta.request_type in BARRIER_TYPES
                first = False
    return ready


def parked(pending: Sequence[PendingMeta]) -> list[PendingMeta]:
    """The pending requests held back behind a barrier."""
    ready = {meta.request_id for meta in dispatchable(pending)}
    return [meta for meta in pending if meta.request_id not in ready]
