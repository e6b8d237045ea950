"""Which pending requests may run now: a pure function of their metadata, never of their payloads."""

from __future__ import annotations

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
    return (meta.model_id, -1 if meta.seq_id is None else meta.seq_id, meta.request_id)


def dispatchable(pending: Sequence[PendingMeta], ordered: bool = False) -> list[PendingMeta]:
    """The requests that may run now, per model in seq order: everything before the model's first pending barrier,
    or the barrier itself when nothing is pending before it; samples always.

    ``ordered``: ``pending`` is already in (model, seq) order, as ``FuturesStore.scan_pending`` returns it.
    """
    ready: list[PendingMeta] = []
    model, first, blocked = None, True, False
    # Runs every scheduler tick over the whole backlog: one pass, no per-model grouping objects.
    for meta in pending if ordered else sorted(pending, key=_order):
        if meta.model_id != model:
            model, first, blocked = meta.model_id, True, False
        kind = meta.request_type
        if kind in BARRIER_FREE_TYPES:
            ready.append(meta)
        elif not blocked:
            is_barrier = kind in BARRIER_TYPES
            if first or not is_barrier:
                ready.append(meta)
            blocked = is_barrier
            first = False
    return ready


def parked(pending: Sequence[PendingMeta]) -> list[PendingMeta]:
    """The pending requests held back behind a barrier."""
    ready = {meta.request_id for meta in dispatchable(pending)}
    return [meta for meta in pending if meta.request_id not in ready]
