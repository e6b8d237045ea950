"""Which commands run together next: a pure function of the models' ready heads, the rotation, the budget and the
service each tenant and model was given (``lilo.engine.fair_share``)."""

from __future__ import annotations

from typing import Mapping, Sequence

from lilo.engine.commands import COALESCING_KINDS, Command, Kind
from lilo.engine.fair_share import Service, cost

TOKENS_PER_BATCH = 8192


class _Standing:
    """Who goes first: the tenant served least, then its model served least, then rotation order; counted up as a
    pass is filled."""

    def __init__(self, heads: Mapping[str, Command], service: Service | None) -> None:
        service = service or Service()
        self._heads = heads
        self._tenants = dict(service.tenants)
        self._turns = dict(service.turns)

    def rank(self, turn: str) -> tuple[float, float]:
        return self._tenants.get(self._heads[turn].tenant, 0.0), self._turns.get(turn, 0.0)

    def first(self, turns: Sequence[str]) -> str:
        return min(turns, key=self.rank)  # min keeps the first of equals: rotation order

    def give(self, turn: str) -> None:
        head = self._heads[turn]
        self._tenants[head.tenant] = self._tenants.get(head.tenant, 0.0) + cost(head)
        self._turns[turn] = self._turns.get(turn, 0.0) + cost(head)


def turn_order(heads: Mapping[str, Command], rotation: Sequence[str], service: Service | None = None) -> list[str]:
    """The turns of ``rotation`` with a ready head, in the order the scheduler would give them places."""
    standing = _Standing(heads, service)
    return sorted((turn for turn in rotation if turn in heads), key=standing.rank)


def next_batch(heads: Mapping[str, Command], rotation: Sequence[str],
               token_budget: int = TOKENS_PER_BATCH, coalesce: bool = True,
               service: Service | None = None) -> list[Command]:
    """The next physical batch: the anchor is the ready model served least of the ready tenant served least
    (``service``; equals in ``rotation`` order, and the engine moves the anchor to the back of the rotation
    afterwards); other models' heads join when they share its coalesce key and, for forward passes, fit the token
    budget, picked by the same rule with the service counted up as the pass fills, so a full pass is shared by
    tenant weight, a tenant's places go to its models evenly, and spare room goes to anyone. The anchor always runs,
    however large. At most one command per model per batch; saves and loads run alone. ``coalesce=False`` runs every
    command alone (for comparison)."""
    standing = _Standing(heads, service)
    ready = [turn for turn in rotation if turn in heads]
    if not ready:
        return []
    anchor_turn = standing.first(ready)
    anchor = heads[anchor_turn]
    batch = [anchor]
    if not coalesce or anchor.kind not in COALESCING_KINDS:
        return batch
    budgeted = anchor.kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD)
    tokens = anchor.tokens
    standing.give(anchor_turn)
    candidates = [turn for turn in ready if turn != anchor_turn and heads[turn].coalesce_key == anchor.coalesce_key]
    while True:
        fitting = [turn for turn in candidates if not budgeted or tokens + heads[turn].tokens <= token_budget]
        if not fitting:
            return batch
        turn = standing.first(fitting)
        batch.append(heads[turn])
        tokens += heads[turn].tokens
        standing.give(turn)
        candidates.remove(turn)
