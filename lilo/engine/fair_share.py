"""Each tenant's share of a trainer whose passes cannot hold every ready command, and each model's share of its
tenant's: weighted fair queuing in two levels.

A tenant's *service* is what it was given, in tokens (at least 1 a command) over its weight (the tenants file's;
the command carries it); a model's (a *turn* of the rotation: a training model, or the samples' queue) is the same
sum over its own commands. The scheduler anchors each pass on the ready model served least of the ready tenant served
least, and fills the pass by the same rule, so tenants get turns in proportion to their weights whatever number of
models each runs, and a tenant's turns go to its models evenly: a model that was not ready when a pass was filled
(a lockstep client between its steps) is behind its tenant's others when it comes back, and goes first. Coalescing
still fills the pass with anyone's ready commands: fairness only orders them, spare room is never left empty.

A tenant that comes back after idling longer than ``IDLE_FORGET_S`` starts at the service of the least served busy
tenant, and a model at that of its tenant's least served busy model: it takes its share again at once, not a burst to
make up for the time it sent nothing. A shorter gap (a lockstep client thinking between steps) keeps what it had, so
its weight holds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Mapping

from lilo.engine.commands import Command

# How long a tenant or model may send nothing and keep its place (longer: it restarts at the busy ones' service).
IDLE_FORGET_S = 5.0


def cost(command: Command) -> float:
    """What a command adds to its tenant's service and its model's: its tokens (at least 1) over its weight."""
    return max(command.tokens, 1) / command.weight


@dataclasses.dataclass(frozen=True)
class Service:
    """What each tenant and each turn (by its rotation name) was given so far; 0 for one never served."""

    tenants: Mapping[str, float] = dataclasses.field(default_factory=dict)
    turns: Mapping[str, float] = dataclasses.field(default_factory=dict)


class _Ledger:
    """Service per key (a tenant, or a turn within its tenant), and when each last had work."""

    def __init__(self) -> None:
        self.served: dict[str, float] = {}
        self.seen: dict[str, float] = {}

    def bring_back(self, ready: Mapping[str, str], now: float) -> None:
        """``ready`` (key -> its group, the keys that compete with it): a key idle longer than ``IDLE_FORGET_S`` starts
        at the least service of its group's busy keys."""
        floors: dict[str, float] = {}
        idle = []
        for key, group in ready.items():
            if now - self.seen.get(key, float("-inf")) > IDLE_FORGET_S:
                idle.append(key)
            else:
                floors[group] = min(floors.get(group, float("inf")), self.served[key])
        for key in idle:
            own, floor = self.served.get(key, 0.0), floors.get(ready[key])
            self.served[key] = own if floor is None else max(own, floor)
        for key in ready:
            self.seen[key] = now

    def charge(self, key: str, amount: float, now: float) -> None:
        self.served[key] = self.served.get(key, 0.0) + amount
        self.seen[key] = now

    def forget(self, key: str) -> None:
        self.served.pop(key, None)
        self.seen.pop(key, None)


class FairShare:
    """Every tenant's service so far and every turn's, and when each last had work."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants = _Ledger()
        self._turns = _Ledger()

    def service(self, heads: Mapping[str, Command]) -> Service:
        """The service of each tenant and turn, those with a head ready now (``heads``: turn -> its next command)
        first brought back from idle."""
        now = self._clock()
        self._tenants.bring_back({head.tenant: "" for head in heads.values()}, now)
        self._turns.bring_back({turn: head.tenant for turn, head in heads.items()}, now)
        return Service(dict(self._tenants.served), dict(self._turns.served))

    def of(self, tenant: str) -> float:
        """``tenant``'s service so far (0 for one never served)."""
        return self._tenants.served.get(tenant, 0.0)

    def charge(self, given: Iterable[tuple[str, Command]]) -> None:
        """Each (turn, command) in ``given`` was given its turn."""
        now = self._clock()
        for turn, command in given:
            self._tenants.charge(command.tenant, cost(command), now)
            self._turns.charge(turn, cost(command), now)

    def forget(self, turn: str) -> None:
        """``turn`` left the rotation (its model was removed)."""
        self._turns.forget(turn)
