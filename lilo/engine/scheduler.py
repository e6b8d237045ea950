"""Which commands run together next: a pure function of the models' ready heads, the rotation and the budget."""

from __future__ import annotations

from typing import Mapping, Sequence

from lilo.engine.commands import COALESCING_KINDS, Command, Kind

TOKENS_PER_BATCH = 8192


def next_batch(heads: Mapping[str, Command], rotation: Sequence[str],
               token_budget: int = TOKENS_PER_BATCH, coalesce: bool = True) -> list[Command]:
    """The next physical batch: the anchor is the first model in ``rotation`` with a ready head (the engine moves
    it to the back afterwards, so no client starves); other models' heads join when they share its coalesce key
    and, for forward passes, fit the token budget (the anchor always runs, however large). At most one command per
    model per batch; saves and loads run alone. ``coalesce=False`` runs every command alone (for comparison)."""
    anchor_model = next((model for model in rotation if model in heads), None)
    if anchor_model is None:
        return []
    anchor = heads[anchor_model]
    batch = [anchor]
    if not coalesce or anchor.kind not in COALESCING_KINDS:
        return batch
    budgeted = anchor.kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD)
    tokens = anchor.tokens
    for model in rotation:
        head = heads.get(model)
        if head is None or model == anchor_model or head.coalesce_key != anchor.coalesce_key:
            continue
        if budgeted and tokens + head.tokens > token_budget:
            continue
        batch.append(head)
        tokens += head.tokens
    return batch
