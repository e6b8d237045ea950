"""Each tenant's share of a trainer's execute time: an engine ``Observer``, beside the critical path.

A pass of several tenants' commands is split among them by tokens (each command at least 1): a tenant whose
commands held 3/4 of a coalesced forward_backward's tokens is charged 3/4 of its seconds. Counted: the compute
lane's work for requests, the executions of every kind and the captures of saves (not paging, windows or the
acceptance of a new model, which no request's tokens explain).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from lilo.timing.critical_path import Operation

# Requests begun and not yet run, remembered (those that never run, refused in their turn, fall out the back).
REMEMBERED = 100_000


class TenantUsage:
    """Per tenant: execute seconds (its share of each pass) and commands run, since the trainer started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: OrderedDict[str, tuple[str, int]] = OrderedDict()  # request id -> (tenant, tokens)
        self._seconds: dict[str, float] = {}
        self._commands: dict[str, int] = {}

    def register_model(self, model_id: str, spec: Any) -> None:
        pass

    def forget_model(self, model_id: str) -> None:
        pass

    def begin(self, operation: Operation) -> None:
        with self._lock:
            self._waiting[operation.request_id] = (operation.tenant, max(operation.tokens, 1))
            while len(self._waiting) > REMEMBERED:
                self._waiting.popitem(last=False)

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None:
        request_ids = attrs.get("request_ids")
        if t1 is None or not request_ids or (":" in name and not name.startswith("capture:")):
            return
        with self._lock:
            shares = [self._waiting.pop(request_id, None) for request_id in request_ids]
            known = [share for share in shares if share is not None]
            total = sum(tokens for _, tokens in known)
            for tenant, tokens in known:
                self._seconds[tenant] = self._seconds.get(tenant, 0.0) + (t1 - t0) * tokens / total
                self._commands[tenant] = self._commands.get(tenant, 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{tenant: {"execute_s": .., "commands": ..}}``."""
        with self._lock:
            return {tenant: {"execute_s": seconds, "commands": self._commands[tenant]}
                    for tenant, seconds in self._seconds.items()}
