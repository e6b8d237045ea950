"""A trainer's result writer (cluster.trainer.results): results finished while a write is in flight go at once in a
call of their own, up to the limit, and together past it; a write the futures DB could not make, or a call that
raised, is tried again until it lands. The futures DB is a stand-in here (a locked file and a failing call are faults
a test cannot cause on demand in a real actor); the real calls run in every SDK test."""

from __future__ import annotations

import asyncio
import threading

from cluster.trainer.results import ResultWriter
from lilo.futures.store import Completion


class FuturesDb:
    """Stands in for the futures DB actor's handle: ``complete.remote(batch)`` records the batch's ids and answers
    what ``answers`` says next (True: written, False: kept in memory, an exception: the call failed), holding each
    call until ``release`` is set."""

    def __init__(self, answers: list[bool | Exception] | None = None) -> None:
        self.calls: list[list[int]] = []
        self.answers = answers or []
        self.release = asyncio.Event()
        self.release.set()
        self.complete = self

    def remote(self, batch: list[Completion]) -> asyncio.Future:
        return asyncio.ensure_future(self._complete([completion.request_id for completion in batch]))

    async def _complete(self, ids: list[int]) -> bool:
        self.calls.append(ids)
        await self.release.wait()
        answer = self.answers.pop(0) if self.answers else True
        if isinstance(answer, Exception):
            raise answer
        return answer


def result(request_id: int) -> Completion:
    return Completion.success(request_id, b"{}", kind="forward_backward")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.01)


def test_results_go_without_waiting_for_a_write_in_flight_and_together_past_the_limit() -> None:
    async def scenario() -> list[list[int]]:
        db = FuturesDb()
        db.release.clear()  # every call stays in flight until released
        writer = ResultWriter(lambda: db, writes_in_flight=2)
        writer.start()
        for request_id in (1, 2):
            writer.put(result(request_id))
            await settle()
        # Both slots are taken: these wait, and go together once a call returns.
        for request_id in (3, 4, 5):
            threading.Thread(target=writer.put, args=(result(request_id),)).start()  # as the torch thread does
        await settle()
        in_flight = [list(call) for call in db.calls]
        db.release.set()
        await settle()
        return [*in_flight, ["then"], *(sorted(call) for call in db.calls[len(in_flight):])]

    assert asyncio.run(scenario()) == [[1], [2], ["then"], [3, 4, 5]]


def test_a_write_kept_in_memory_or_failed_is_tried_again_until_it_lands() -> None:
    async def scenario() -> tuple[list[list[int]], int]:
        db = FuturesDb(answers=[False, RuntimeError("the futures DB actor died"), True])
        lookups = []
        writer = ResultWriter(lambda: lookups.append(1) or db, retry_s=0.01)
        writer.start()
        writer.put(result(7))
        await settle()
        return db.calls, len(lookups)

    calls, lookups = asyncio.run(scenario())
    assert calls == [[7], [7], [7]]  # locked, raised, written
    assert lookups == 2  # found at the start, and again after the call that raised


def test_results_put_while_the_futures_db_was_not_found_go_once_the_writer_starts_again() -> None:
    async def scenario() -> list[list[int]]:
        db = FuturesDb()
        lookups = iter([LookupError("the futures DB is not up yet"), db])

        def find() -> FuturesDb:
            found = next(lookups)
            if isinstance(found, Exception):
                raise found
            return found

        writer = ResultWriter(find)
        writer.start()
        await settle()  # its writer stopped: no futures DB to write to
        writer.put(result(3))
        await settle()
        writer.start()  # as the trainer's next report does
        await settle()
        return db.calls

    assert asyncio.run(scenario()) == [[3]]
