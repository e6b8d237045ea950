"""An ingress replica's end of the pushed results (``lilo.futures.pushes``): what it submitted, the results the
futures DB pushed back for them, and the retrieves waiting for those, answered here without an actor call each.

Listener tasks take the replica's box in a loop (long-polls, answered as soon as results are written): two, so that
while one brings a batch back the other already waits for the next (with one, each batch waited for the round trip of
the one before: an optim_step's result behind its forward_backward's). A retrieve of a request this replica submitted
waits here; of any other (another replica's, an id from before a restart, another tenant's) it returns None, and the
caller asks the futures DB as before. So does a retrieve whose wait here times out, and every one once the futures DB
restarted (its subscriptions went with it) or cannot be reached: pushes only ever save calls, they never decide an
answer alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from typing import Any

from lilo.futures.store import FutureState
from lilo.tenants import may_see

logger = logging.getLogger(__name__)

# How long one take waits for results (the listener then asks again at once).
TAKE_TIMEOUT_S = 30.0
# Takes each replica keeps waiting at the futures DB.
LISTENERS = 2
# Requests this replica holds at most (pending, or finished and not yet retrieved), and bytes of results held for
# retrieves still to come: past them the oldest are dropped, and the futures DB (which keeps every result) answers.
MAX_HELD = 100_000
MAX_HELD_BYTES = 64 << 20


class PushedResults:
    def __init__(self, futures: Any) -> None:
        self.subscriber = f"ingress-{uuid.uuid4().hex[:16]}"
        self._futures = futures
        # Each request submitted here: its result once pushed, until its retrieve takes it.
        self._held: collections.OrderedDict[int, asyncio.Future] = collections.OrderedDict()
        self._held_bytes = 0
        self._incarnation: str | None = None  # the futures DB's, as the first take said
        self._listeners: list[asyncio.Task] = []

    def submitted(self, request_id: int) -> None:
        """This replica recorded ``request_id`` (with its ``subscriber``): its result will be pushed here."""
        if request_id not in self._held:
            self._held[request_id] = asyncio.get_running_loop().create_future()
            if len(self._held) > MAX_HELD:
                self._drop(next(iter(self._held)))
        self._listeners = [task for task in self._listeners if not task.done()]
        while len(self._listeners) < LISTENERS:
            self._listeners.append(asyncio.create_task(self._listen(), name="lilo-pushed-results"))

    async def wait(self, request_id: int, timeout_s: float, tenant: str | None) -> FutureState | None:
        """``request_id``'s finished state once pushed here, if ``tenant`` may see it; None where this replica
        cannot say (ask the futures DB). Raises TimeoutError when no push came within ``timeout_s`` (the futures DB
        then has the last word: a lookup)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        try:
            state = await asyncio.wait_for(asyncio.shield(held), timeout_s)
        except asyncio.CancelledError:
            if held.cancelled():  # the pushes stopped: the futures DB answers
                return None
            raise  # the retrieve itself was cancelled
        except TimeoutError:
            self._drop(request_id)  # no push came: from now on the futures DB answers for it
            raise
        self._drop(request_id)  # handed over; a retried retrieve asks the futures DB, which keeps every result
        return state if may_see(tenant, state.tenant) else None

    async def _listen(self) -> None:
        while self._held:
            try:
                incarnation, states = await self._futures.finished_for.remote(self.subscriber, TAKE_TIMEOUT_S)
            except Exception as error:  # the futures DB died or restarts: whatever waits here asks it instead
                logger.info("pushed results stopped (%s); retrieves ask the futures DB", error)
                self._give_up()
                return
            if self._incarnation not in (None, incarnation):
                self._give_up()  # a restarted futures DB: the subscriptions went with the old one
            self._incarnation = incarnation
            for state in states:
                held = self._held.get(state.request_id)
                if held is not None and not held.done():
                    held.set_result(state)
                    self._held_bytes += _size(state)
            while self._held_bytes > MAX_HELD_BYTES:
                self._drop(next(request_id for request_id, held in self._held.items() if held.done()))

    def _drop(self, request_id: int) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if held.done() and not held.cancelled():
            self._held_bytes -= _size(held.result())
        else:
            held.cancel()

    def _give_up(self) -> None:
        for request_id in list(self._held):
            self._drop(request_id)
        self._incarnation = None


def _size(state: FutureState) -> int:
    return len(state.result or b"") + len(state.error or "")
