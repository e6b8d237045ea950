"""Long polls of sampling sessions (the SDK's ``retrieve_futures``), answered from the ledger in batches.

``SessionWaiter.wait(target, cursor, timeout_s)`` parks a poll until its session has samples finished after
``cursor``. The ledger is asked only when its answer can have changed: when polls arrive (every poll parked by
then shares the one statement) and after each write that finished samples (``wake``: the futures DB actor writes
every result itself, so it knows). So an idle session's long poll costs one statement however long it waits, and
a burst of completions one statement per write, shared by all parked polls, never one per poll or per sample.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

from lilo.futures.session_completions import FinishedRequest, SessionTarget

logger = logging.getLogger(__name__)

Poll = tuple[SessionTarget, int]
Answer = tuple[list[FinishedRequest], int]
Fetch = Callable[[Sequence[Poll]], Awaitable[dict[Poll, Answer]]]


class SessionWaiter:
    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._parked: dict[asyncio.Future, Poll] = {}
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.queries = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

    async def wait(self, target: SessionTarget, cursor: int, timeout_s: float) -> Answer:
        """What finished in ``target`` after ``cursor``, and the next cursor; once something has, or, after
        ``timeout_s`` with nothing, no completions and the same cursor."""
        if timeout_s <= 0:
            return (await self._ask([(target, cursor)]))[(target, cursor)]
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._parked[future] = (target, cursor)
        self.wake()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return [], cursor
        finally:
            self._parked.pop(future, None)

    def wake(self) -> None:
        """Samples may have finished (or polls arrived): ask the ledger for every parked poll, once."""
        if not self._parked:
            return
        self._due.set()
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
        return await self._fetch(polls)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
