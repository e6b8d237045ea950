"""Waiting for futures: one background task answers every waiter with one query per tick.

``FutureWaiter.wait(request_id)`` parks a caller on an asyncio future. While anyone is parked, one task asks the
store for all parked ids at once (``WHERE request_id IN (...)``), at once when it starts and then every ``tick_s``,
and resolves the finished ones; an id with no row gets the error ``missing`` makes for it (unknown or pruned).
So even a burst of new callers costs one query per tick, not one each. ``notify`` resolves waiters of a result
written in this same process with no query at all, and keeps the latest ``recent`` such results: a caller asking
for one right after it landed (the usual case: the result beat the client's poll) gets it at once instead of
waiting for the next tick. With nobody parked, nothing is queried.

A request this process recorded pending is ``expect``-ed: its result will be written here, and ``notify`` wakes its
waiters, so polling it would find nothing new. Expected ids are asked only every ``expected_poll_s``, a safety net
for a result written another way (the outbox's late write); a caller waiting for one costs no query at all.

A caller waits as a tenant: another tenant's request is answered like one with no row (the ``missing`` error), by
the same query, so the check costs nothing more; a remembered result is handed only to its own tenant.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable, Sequence

from lilo.futures.store import FutureState
from lilo.tenants import may_see

logger = logging.getLogger(__name__)

TICK_S = 0.05
EXPECTED_POLL_S = 1.0
MAX_EXPECTED = 100_000
RECENT = 1024
# After a poll failed (the database away): the next one waits this long, so an outage is not asked every tick.
RETRY_S = 1.0

Fetch = Callable[[Sequence[int]], Awaitable[dict[int, FutureState]]]
Missing = Callable[[int], Awaitable[Exception]]


class FutureWaiter:
    def __init__(self, fetch: Fetch, tick_s: float = TICK_S, missing: Missing | None = None,
                 recent: int = RECENT, retry_s: float = RETRY_S, expected_poll_s: float = EXPECTED_POLL_S) -> None:
        self._fetch = fetch
        self._missing = missing
        self._tick_s = tick_s
        self._retry_s = retry_s
        self._expected_poll_s = expected_poll_s
        self._expected: set[int] = set()  # recorded pending here: ``notify`` will come
        self._safety_net_at = 0.0  # when a poll next asks the expected ids too
        self._recent: collections.OrderedDict[int, FutureState] = collections.OrderedDict()
        self._recent_max = recent
        # request id -> (waiter, its tenant) for every parked caller
        self._parked: dict[int, list[tuple[asyncio.Future, str | None]]] = {}
        self._poller: asyncio.Task | None = None
        self.queries = 0  # statements the ticks ran, for stats and benchmarks

    @property
    def parked(self) -> int:
        return sum(len(waiters) for waiters in self._parked.values())

    async def wait(self, request_id: int, timeout_s: float, tenant: str | None = None) -> FutureState:
        """The finished state of ``request_id``, if ``tenant`` may see it (None: anyone); raises TimeoutError after
        ``timeout_s``."""
        known = self._recent.get(request_id)
        if known is not None and may_see(tenant, known.tenant):
            return known
        future = asyncio.get_running_loop().create_future()
        entry = (future, tenant)
        self._parked.setdefault(request_id, []).append(entry)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="lilo-future-waiter")
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            waiters = self._parked.get(request_id)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._parked[request_id]

    def expect(self, request_id: int) -> None:
        """``request_id`` was recorded pending by this process, which will ``notify`` its result: its waiters need
        no polling (but for the safety net)."""
        if len(self._expected) >= MAX_EXPECTED:  # results written elsewhere and never waited for: forget them all
            self._expected.clear()
        self._expected.add(request_id)

    def notify(self, state: FutureState) -> None:
        """Resolve the waiters of a result this process just wrote, without asking the store. (Waiters of another
        tenant stay parked: the next poll answers them as for a request that does not exist.)"""
        self._expected.discard(state.request_id)
        self._recent[state.request_id] = state
        self._recent.move_to_end(state.request_id)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        others = []
        for future, tenant in self._parked.pop(state.request_id, []):
            if not may_see(tenant, state.tenant):
                others.append((future, tenant))
            elif not future.done():
                future.set_result(state)
        if others:
            self._parked[state.request_id] = others

    async def _poll(self) -> None:
        while self._parked:
            now = asyncio.get_running_loop().time()
            ids = list(self._parked)
            if now >= self._safety_net_at:
                self._safety_net_at = now + self._expected_poll_s
            else:
                ids = [request_id for request_id in ids if request_id not in self._expected]
            pause = self._tick_s
            if not ids:
                await asyncio.sleep(pause)
                continue
            try:
                self.queries += 1
                states = await self._fetch(ids)
                for request_id in ids:
                    state = states.get(request_id)
                    if state is None or self._has_others(request_id, state):
                        if self._missing is not None:
                            self._fail(request_id, await self._missing(request_id), state)
                    if state is not None and state.finished:
                        self.notify(state)
            except Exception:
                logger.exception("polling %d parked futures failed; trying again in %g s", len(ids), self._retry_s)
                pause = self._retry_s
            await asyncio.sleep(pause)

    def _has_others(self, request_id: int, state: FutureState) -> bool:
        return any(not may_see(tenant, state.tenant) for _, tenant in self._parked.get(request_id, []))

    def _fail(self, request_id: int, error: Exception, state: FutureState | None = None) -> None:
        """Fail the waiters of ``request_id`` (with a ``state``: only those of other tenants than its own)."""
        kept = []
        for future, tenant in self._parked.pop(request_id, []):
            if state is not None and may_see(tenant, state.tenant):
                kept.append((future, tenant))
            elif not future.done():
                future.set_exception(error)
        if kept:
            self._parked[request_id] = kept

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
