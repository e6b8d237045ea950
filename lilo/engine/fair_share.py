"""Each tenant's share of a trainer whose passes cannot hold every ready command: weighted fair queuing by tenant.

A tenant's *service* is what it was given, in tokens (at least 1 a command) over its weight (the tenants file's;
the command carries it). The scheduler anchors each pass on the ready tenant served least and fills the pass by the
same rule, so tenants get turns in proportion to their weights whatever number of models each runs, and a tenant's
own models share its turns in rotation order. Coalescing still fills the pass with anyone's ready commands: fairness
only orders them, spare room is never left empty.

A tenant that comes back after idling longer than ``IDLE_FORGET_S`` starts at the service of the least served busy
tenant: it takes its share again at once, not a burst to make up for the time it sent nothing. A shorter gap (a
lockstep client thinking between steps) keeps what it had, so its weight holds.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from lilo.engine.commands import Command

# How long a tenant may send nothing and keep its place (longer: it restarts at the busy tenants' service).
IDLE_FORGET_S = 5.0


def cost(command: Command) -> float:
    """What a command adds to its tenant's service: its tokens (at least 1) over its weight."""
    return max(command.tokens, 1) / command.weight


class FairShare:
    """Every tenant's service so far, and when it last had work."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._served: dict[str, float] = {}
        self._seen: dict[str, float] = {}

    def service(self, ready: Iterable[str]) -> Mapping[str, float]:
        """The service of each tenant, the ``ready`` ones (with a command ready now) first brought back from idle."""
        now, ready = self._clock(), set(ready)
        busy = [self._served[t] for t in ready if now - self._seen.get(t, float("-inf")) <= IDLE_FORGET_S]
        floor = min(busy, default=None)
        for tenant in ready:
            if now - self._seen.get(tenant, float("-inf")) > IDLE_FORGET_S:
                own = self._served.get(tenant, 0.0)
                self._served[tenant] = own if floor is None else max(own, floor)
            self._seen[tenant] = now
        return self._served

    def of(self, tenant: str) -> float:
        """``tenant``'s service so far (0 for one never served)."""
        return self._served.get(tenant, 0.0)

    def charge(self, commands: Iterable[Command]) -> None:
        """``commands`` were given their turn."""
        now = self._clock()
        for command in commands:
            self._served[command.tenant] = self._served.get(command.tenant, 0.0) + cost(command)
            self._seen[command.tenant] = now
