"""Which commands run together next: a pure function of the models' ready heads, the rotation and the budget."""

from __future__ import annotations

from typing import Mapping, Sequence

from lilo.engine.commands import COALESCING_KINDS, Command, Kind
from lilo.engine.fair_share import cost

TOKENS_PER_BATCH = 8192


def next_batch(heads: Mapping[str, Command], rotation: Sequence[str],
               token_budget: int = TOKENS_PER_BATCH, coalesce: bool = True,
               service: Mapping[str, float] | None = None) -> list[Command]:
    """The next physical batch: the anchor is the first model in ``rotation`` with a ready head among those of the
    tenant served least (``service``, lilo.engine.fair_share; the engine moves the anchor to the back of the
    rotation afterwards, so no client starves); other models' heads join when they share its coalesce key and, for
    forward passes, fit the token budget, picked by the same rule (the least served tenant's first, its service
    counted up as it goes), so a full pass is shared by weight and spare room goes to anyone. The anchor always
    runs, however large. At most one command per model per batch; saves and loads run alone. ``coalesce=False``
    runs every command alone (for comparison)."""
    served = dict(service or {})
    ready = [model for model in rotation if model in heads]
    if not ready:
        return []

    def least_served(models: Sequence[str]) -> str:  # min keeps the first of equals: rotation order
        return min(models, key=lambda model: served.get(heads[model].tenant, 0.0))

    anchor_model = least_served(ready)
    anchor = heads[anchor_model]
    batch = [anchor]
    if not coalesce or anchor.kind not in COALESCING_KINDS:
        return batch
    budgeted = anchor.kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD)
    tokens = anchor.tokens
    served[anchor.tenant] = served.get(anchor.tenant, 0.0) + cost(anchor)
    candidates = [model for model in ready if model != anchor_model
                  and heads[model].coalesce_key == anchor.coalesce_key]
    while True:
        fitting = [model for model in candidates if not budgeted or tokens + heads[model].tokens <= token_budget]
        if not fitting:
            return batch
        model = least_served(fitting)
        head = heads[model]
        batch.append(head)
        tokens += head.tokens
        served[head.tenant] = served.get(head.tenant, 0.0) + cost(head)
        candidates.remove(model)
