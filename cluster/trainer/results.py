"""A trainer's finished results on their way to the futures DB.

The thread that finished a command puts its completion here; a writer task on the actor's event loop sends what has
come in one ``complete`` call. Up to ``WRITES_IN_FLIGHT`` calls are in flight: a lockstep client's optim_step
finishes a moment after its forward_backward, and one call at a time made its result wait for the round trip of the
forward_backward's (about 3 ms of every step with one client on a small machine, docs/benchmarks.md). What finishes
while every call is out goes in the next one together, so results batch up exactly when the futures DB is the
bottleneck.
A write that fails, or that the futures DB could only keep in memory (its file stayed locked), is tried again after
``RETRY_WRITE_S``: results stay here until written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from typing import Any, Callable

from lilo.futures.store import Completion

logger = logging.getLogger(__name__)

# How long a failed write of results to the futures DB waits before it is tried again.
RETRY_WRITE_S = 1.0
# ``complete`` calls one trainer keeps in flight to the futures DB.
WRITES_IN_FLIGHT = 4


class ResultWriter:
    """``put`` from any thread; the writer starts on the event loop of the first ``start``. ``futures_db`` finds the
    futures DB actor (again after a failed call: it may have restarted)."""

    def __init__(self, futures_db: Callable[[], Any], writes_in_flight: int = WRITES_IN_FLIGHT,
                 retry_s: float = RETRY_WRITE_S) -> None:
        self._find_futures_db = futures_db
        self._writes_in_flight = writes_in_flight
        self._retry_s = retry_s
        self._outbox: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None
        self._futures_db: Any = None

    def start(self) -> None:
        """Run the writer on the calling event loop, unless it runs already."""
        if self._writer is None or self._writer.done():
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            self._writer = self._loop.create_task(self._write_forever(), name="lilo-trainer-results")
            if not self._outbox.empty():  # left by a writer that stopped (the futures DB not found yet)
                self._wake.set()

    def put(self, completion: Completion) -> None:
        """Write ``completion`` soon: callable from any thread, once ``start`` ran."""
        self._outbox.put(completion)
        assert self._loop is not None and self._wake is not None, "ResultWriter.put before start"
        self._loop.call_soon_threadsafe(self._wake.set)

    async def _write_forever(self) -> None:
        assert self._wake is not None
        self._futures_db = self._find_futures_db()
        slots = asyncio.Semaphore(self._writes_in_flight)
        while True:
            await self._wake.wait()
            self._wake.clear()
            await slots.acquire()  # what comes meanwhile joins this batch
            batch = self._take()
            if not batch:
                slots.release()
                continue
            write = asyncio.create_task(self._write(batch))
            write.add_done_callback(lambda _: slots.release())

    def _take(self) -> list[Completion]:
        batch: list[Completion] = []
        while not self._outbox.empty():
            batch.append(self._outbox.get_nowait())
        return batch

    async def _write(self, batch: list[Completion]) -> None:
        """Write ``batch``; on failure put it back, to go again after ``RETRY_WRITE_S``."""
        try:
            # False: the file stayed locked, and the futures DB keeps them in memory for its next write. They
            # stay here too until written: that memory goes if the futures DB actor dies.
            if await self._futures_db.complete.remote(batch):
                return
            logger.warning("%d result(s) not written yet (the futures DB is locked); retrying", len(batch))
        except Exception:
            logger.exception("writing %d result(s) to the futures DB failed; retrying", len(batch))
            with contextlib.suppress(Exception):  # found again, in case it restarted; else the next retry tries
                self._futures_db = self._find_futures_db()
        await asyncio.sleep(self._retry_s)
        for completion in batch:
            self._outbox.put(completion)
        assert self._wake is not None
        self._wake.set()
