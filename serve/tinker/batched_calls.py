"""One actor call for the requests that arrive together: an ingress replica's submissions to the futures DB, and its
hand-offs to each trainer.

Each request is one item. An item that finds no call in flight goes at once, in a call of its own, sent from its
caller's own coroutine; items that come while a call is in flight wait for it to return and then go together in the
next call (group commit, as the futures DB does with its transactions). A lone client's request is never held back,
and lockstep clients, whose requests come in bursts (each pass's results reach them together), cost one call a
burst instead of one each: on a small machine each actor call costs about a millisecond of CPU on both sides
(docs/benchmarks.md, ``bench_op_latency``).
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
                 max_items: int = MAX_ITEMS_PER_CALL) -> None:
        self._send = send
        self._max_items = max_items
        self._waiting: list[tuple[Item, asyncio.Future]] = []
        self._in_flight = False

    async def call(self, item: Item) -> Result:
        if self._in_flight:
            answer = asyncio.get_running_loop().create_future()
            self._waiting.append((item, answer))
            return await answer
        self._in_flight = True
        try:
            (result,) = await self._answers([item])
        finally:
            self._send_next()
        if isinstance(result, BaseException):
            raise result
        return result

    async def _answers(self, items: list[Item]) -> list[Result | BaseException]:
        results = list(await self._send(items))
        if len(results) != len(items):
            raise RuntimeError(f"{len(results)} answers came back for {len(items)} requests")
        return results

    def _send_next(self) -> None:
        """After a call returned: send what came meanwhile, or say no call is in flight."""
        if self._waiting:
            asyncio.get_running_loop().create_task(self._send_waiting())
        else:
            self._in_flight = False

    async def _send_waiting(self) -> None:
        batch: list[tuple[Item, asyncio.Future]] = []
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[:self._max_items], self._waiting[self._max_items:]
                try:
                    results = await self._answers([item for item, _ in batch])
                except Exception as error:
                    results = [error] * len(batch)
                for (_, answer), result in zip(batch, results):
                    if answer.done():  # its caller went away (its request was cancelled)
                        continue
                    if isinstance(result, BaseException):
                        answer.set_exception(result)
                    else:
                        answer.set_result(result)
                batch = []
        except BaseException as stopped:  # this task was cancelled (the replica is stopping): nobody waits forever
            for _, answer in [*batch, *self._waiting]:
                if not answer.done():
                    answer.set_exception(RuntimeError(f"the ingress stopped before answering: {stopped!r}"))
            self._waiting = []
            raise
        finally:
            self._in_flight = False
