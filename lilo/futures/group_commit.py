"""Group commit without reordering: submissions that arrive together share one commit, in arrival order.

Only this committer allocates request ids (one writer), so ids follow the order submissions reached it, whether
they waited for a shared commit or not: the barrier scheduling that depends on that order stays correct.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from lilo.futures.store import Submission, SubmitOutcome

Commit = Callable[[Sequence[Submission]], Awaitable[list[SubmitOutcome]]]
MAX_GROUP = 1024


class GroupCommitter:
    def __init__(self, commit: Commit, max_group: int = MAX_GROUP) -> None:
        self._commit = commit
        self._max_group = max_group
        self._queue: list[tuple[Submission, asyncio.Future]] = []
        self._committing: asyncio.Task | None = None
        self.commits = 0

    async def submit(self, submission: Submission) -> SubmitOutcome:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((submission, future))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.create_task(self._drain(), name="lilo-group-commit")
        return await future

    async def _drain(self) -> None:
        # Whatever queued while one commit ran goes, in order, into the next one.
        while self._queue:
            group, self._queue = self._queue[:self._max_group], self._queue[self._max_group:]
            try:
                outcomes = await self._commit([submission for submission, _ in group])
            except Exception as error:
                for _, future in group:
                    if not future.done():
                        future.set_exception(error)
                continue
            self.commits += 1
            for (_, future), outcome in zip(group, outcomes):
                if not future.done():
                    future.set_result(outcome)
