"""One actor call for the requests that arrive together: an ingress replica's submissions to the futures DB, and its
hand-offs to each trainer.

Each request is one item. An item that finds nothing in flight goes at once, in a call of its own, sent from its
caller's own coroutine. Items that come while ``max_in_flight`` calls are in flight wait for one to return and then
go together in the next call (group commit, as the futures DB does with its transactions). Below that limit, the
items that come in one turn of the event loop go together in a call of their own, at once. So a lone client's request
is never held back, and lockstep clients, whose requests come in bursts (each pass's results reach them together),
cost a call or two a burst instead of one each: on a small machine each actor call costs about a millisecond of CPU on
both sides (docs/benchmarks.md, ``bench_op_latency``).

The futures DB gets one call in flight per replica, so a burst is recorded in few transactions. A trainer gets
several: a hand-off that waited for the one before it to come back would chain round trips between the replica and
the trainer, each as slow as the busiest of the two, while the pass waits for the burst's last command (a trainer
queues each model's commands in seq order, whatever order they come in).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# At most this many items a call: a burst larger than this goes in several (a big call delays its first item's
# answer, and its payloads travel as one Ray object).
MAX_ITEMS_PER_CALL = 32


class BatchedCalls(Generic[Item, Result]):
    """``call(item)`` answers as ``send([item, ...])`` answers that item: with its result, or by raising the
    exception ``send`` put in its place. A ``send`` that raises fails every item of its call with that error."""

    def __init__(self, send: Callable[[list[Item]], Awaitable[Sequence[Result | BaseException]]],
                 max_items: int = MAX_ITEMS_PER_CALL, max_in_flight: int = 1) -> None:
        self._send = send
        self._max_items = max_items
        self._max_in_flight = max_in_flight
        self._waiting: list[tuple[Item, asyncio.Future]] = []
        self._in_flight = 0
        self._flush_due = False

    async def call(self, item: Item) -> Result:
        if self._in_flight or self._waiting:
            answer = asyncio.get_running_loop().create_future()
            self._waiting.append((item, answer))
            self._flush_soon()
            return await answer
        self._in_flight += 1
        try:
            (result,) = await self._answers([item])
        finally:
            self._in_flight -= 1
            self._flush_soon()
        if isinstance(result, BaseException):
            raise result
        return result

    async def _answers(self, items: list[Item]) -> list[Result | BaseException]:
        results = list(await self._send(items))
        if len(results) != len(items):
            raise RuntimeError(f"{len(results)} answers came back for {len(items)} requests")
        return results

    def _flush_soon(self) -> None:
        """Send what waits, once this turn of the event loop is over (so that the items that come in it go together),
        if a call may go then."""
        if self._waiting and self._in_flight < self._max_in_flight and not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        loop = asyncio.get_running_loop()
        while self._waiting and self._in_flight < self._max_in_flight:
            batch, self._waiting = self._waiting[:self._max_items], self._waiting[self._max_items:]
            self._in_flight += 1
            loop.create_task(self._send_waiting(batch))

    async def _send_waiting(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            try:
                results = await self._answers([item for item, _ in batch])
            except Exception as error:
                results = [error] * len(batch)
        except BaseException as stopped:  # this task was cancelled (the replica is stopping): nobody waits forever
            for _, answer in [*batch, *self._waiting]:
                if not answer.done():
                    answer.set_exception(RuntimeError(f"the ingress stopped before answering: {stopped!r}"))
            self._waiting = []
            raise
        finally:
            self._in_flight -= 1
        for (_, answer), result in zip(batch, results):
            if answer.done():  # its caller went away (its request was cancelled)
                continue
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)
        self._flush_soon()
