"""An ingress replica's end of the pushed results (``lilo.futures.pushes``): what it handed to each trainer, the
results the trainers pushed back for them, and the retrieves waiting for those, answered here without an actor call
each.

A trainer pushes each result as it comes out of a pass, while the futures DB writes it: so a client's result does not
wait for the write and a second hop from the futures DB (about 2 ms of each operation on a small machine,
docs/benchmarks.md), and the one futures DB does not relay every result of every trainer.

Listener tasks take this replica's box at each trainer it has requests pending on, in a loop (long-polls, answered
as soon as results are out): two a trainer, so that while one brings a batch back the other already waits for the
next (with one, each batch waited for the round trip of the one before: an optim_step's result behind its
forward_backward's). A retrieve of a request this replica handed over waits here; of any other (another replica's, an
id from before a restart, another tenant's) it returns None, and the caller asks the futures DB as before. So does a
retrieve whose wait here times out, and every one pending on a trainer that restarted (its subscriptions went with it)
or cannot be reached: pushes only ever save calls, they never decide an answer the futures DB would not give.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from typing import Any, Callable

from lilo.futures.store import FutureState
from lilo.tenants import may_see

logger = logging.getLogger(__name__)

# How long one take waits for results (the listener then asks again at once).
TAKE_TIMEOUT_S = 30.0
# Takes each replica keeps waiting at each trainer.
LISTENERS = 2
# Requests this replica holds at most (pending, or finished and not yet retrieved), and bytes of results held for
# retrieves still to come: past them the oldest are dropped, and the futures DB (which keeps every result) answers.
MAX_HELD = 100_000
MAX_HELD_BYTES = 64 << 20


@dataclasses.dataclass
class _Held:
    trainer: str  # whose push it waits for
    result: asyncio.Future  # its FutureState, once pushed


@dataclasses.dataclass
class _Trainer:
    pending: int = 0  # requests held here whose result has not come yet
    incarnation: str | None = None  # the trainer's, as its first take said
    listeners: list[asyncio.Task] = dataclasses.field(default_factory=list)


class PushedResults:
    def __init__(self, trainer_actor: Callable[[str], Any]) -> None:
        """``trainer_actor``: the actor handle of a trainer, by name."""
        self.subscriber = f"ingress-{uuid.uuid4().hex[:16]}"
        self._trainer_actor = trainer_actor
        self._held: collections.OrderedDict[int, _Held] = collections.OrderedDict()
        self._held_bytes = 0
        self._trainers: dict[str, _Trainer] = {}

    def submitted(self, request_id: int, trainer: str) -> None:
        """This replica hands ``request_id`` to ``trainer`` (naming its ``subscriber``): its result will be pushed
        here."""
        if request_id in self._held:
            return
        self._held[request_id] = _Held(trainer, asyncio.get_running_loop().create_future())
        source = self._trainers.setdefault(trainer, _Trainer())
        source.pending += 1
        if len(self._held) > MAX_HELD:
            self._drop(next(iter(self._held)))
        source.listeners = [task for task in source.listeners if not task.done()]
        while len(source.listeners) < LISTENERS:
            source.listeners.append(asyncio.create_task(self._listen(trainer), name=f"lilo-pushed-results-{trainer}"))

    def forget(self, request_id: int) -> None:
        """Nothing will be retrieved of ``request_id`` here (its hand-over failed, and the client was told so)."""
        self._drop(request_id)

    async def wait(self, request_id: int, timeout_s: float, tenant: str | None) -> FutureState | None:
        """``request_id``'s finished state once pushed here, if ``tenant`` may see it; None where this replica
        cannot say (ask the futures DB). Raises TimeoutError when no push came within ``timeout_s`` (the futures DB
        then has the last word: a lookup)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        try:
            state = await asyncio.wait_for(asyncio.shield(held.result), timeout_s)
        except asyncio.CancelledError:
            if held.result.cancelled():  # the pushes stopped: the futures DB answers
                return None
            raise  # the retrieve itself was cancelled
        except TimeoutError:
            self._drop(request_id)  # no push came: from now on the futures DB answers for it
            raise
        self._drop(request_id)  # handed over; a retried retrieve asks the futures DB, which keeps every result
        return state if may_see(tenant, state.tenant) else None

    async def _listen(self, trainer: str) -> None:
        source = self._trainers[trainer]
        while source.pending:
            try:
                incarnation, states = await self._trainer_actor(trainer).finished_for.remote(self.subscriber,
                                                                                            TAKE_TIMEOUT_S)
            except Exception as error:  # the trainer died or restarts: what waits on it asks the futures DB instead
                logger.info("pushed results of %s stopped (%s); retrieves ask the futures DB", trainer, error)
                self._give_up(trainer)
                return
            if source.incarnation not in (None, incarnation):
                self._give_up(trainer)  # a restarted trainer: the subscriptions went with the old one
            source.incarnation = incarnation
            for state in states:
                held = self._held.get(state.request_id)
                if held is not None and not held.result.done():
                    held.result.set_result(state)
                    source.pending -= 1
                    self._held_bytes += _size(state)
            while self._held_bytes > MAX_HELD_BYTES:
                self._drop(next(request_id for request_id, held in self._held.items() if held.result.done()))

    def _drop(self, request_id: int) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if held.result.done() and not held.result.cancelled():
            self._held_bytes -= _size(held.result.result())
        else:
            held.result.cancel()
            self._trainers[held.trainer].pending -= 1

    def _give_up(self, trainer: str) -> None:
        """Whatever still waits for ``trainer``'s push asks the futures DB (what it pushed before stays)."""
        for request_id in [request_id for request_id, held in self._held.items()
                           if held.trainer == trainer and not held.result.done()]:
            self._drop(request_id)
        self._trainers[trainer].incarnation = None


def _size(state: FutureState) -> int:
    return len(state.result or b"") + len(state.error or "")
