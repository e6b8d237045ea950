"""Long polls of sampling sessions (the SDK's ``retrieve_futures``), answered from the ledger in batches.

``SessionWaiter.wait(target, cursor, timeout_s)`` parks a poll until its session has samples finished after
``cursor``. The ledger is asked only when its answer can have changed: after each write that finished samples
(``wake``: the futures DB actor writes every result itself, so it knows), and when a poll arrives with a cursor
the waiter cannot vouch for. It can for the usual one: the cursor it answered the session's previous poll with,
no such write since. Every poll parked at the time shares the one statement. So a client polling in a loop costs
one statement per write that finished samples while it waits, shared with every other parked poll: never one per
poll or per sample, and none while nothing finishes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

from lilo.futures.session_completions import PAGE, FinishedRequest, SessionTarget

logger = logging.getLogger(__name__)

Poll = tuple[SessionTarget, int]
Answer = tuple[list[FinishedRequest], int]
Fetch = Callable[[Sequence[Poll]], Awaitable[dict[Poll, Answer]]]
MAX_ANSWERED = 100_000  # sessions whose last answer is remembered (past it, all are forgotten)


class SessionWaiter:
    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._parked: dict[asyncio.Future, Poll] = {}
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._writes = 0  # writes that finished samples, so far (``wake``)
        # target -> (the cursor its last answer gave, ``_writes`` when that answer was read)
        self._answered: dict[SessionTarget, tuple[int, int]] = {}
        self.queries = self.polls = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

    async def wait(self, target: SessionTarget, cursor: int, timeout_s: float) -> Answer:
        """What finished in ``target`` after ``cursor``, and the next cursor; once something has, or, after
        ``timeout_s`` with nothing, no completions and the same cursor."""
        self.polls += 1
        if self._answered.get(target) == (cursor, self._writes):
            if timeout_s <= 0:
                return [], cursor  # nothing finished since this cursor was answered
        elif timeout_s <= 0:
            return (await self._ask([(target, cursor)]))[(target, cursor)]
        else:
            self._due.set()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._parked[future] = (target, cursor)
        self._start()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return [], cursor
        finally:
            self._parked.pop(future, None)

    def wake(self) -> None:
        """A write finished samples: ask the ledger for every parked poll, once."""
        self._writes += 1
        if self._parked:
            self._due.set()
            self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._answer(), name="lilo-session-waiter")

    async def _answer(self) -> None:
        while self._parked:
            await self._due.wait()
            self._due.clear()
            parked = dict(self._parked)
            if not parked:
                return
            try:
                answers = await self._ask(list(set(parked.values())))
            except Exception:
                logger.exception("polling %d sampling sessions failed; trying again", len(parked))
                await asyncio.sleep(1.0)
                self._due.set()
                continue
            for future, poll in parked.items():
                completions, cursor = answers[poll]
                if completions and not future.done():
                    future.set_result((completions, cursor))

    async def _ask(self, polls: Sequence[Poll]) -> dict[Poll, Answer]:
        self.queries += 1
        writes = self._writes  # read before the statement runs: a write it may miss counts after it
        answers = await self._fetch(polls)
        if len(self._answered) > MAX_ANSWERED:
            self._answered.clear()
        for (target, _), (completions, cursor) in answers.items():
            if len(completions) < PAGE:  # else a page may have been left for the next poll
                self._answered[target] = (cursor, writes)
        return answers

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
