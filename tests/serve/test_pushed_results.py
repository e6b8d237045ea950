"""An ingress replica's pushed results (serve.tinker.pushed_results) on a real event loop: each request waits for the
push of the trainer it was handed to; what waits on a trainer whose takes fail, or that comes back restarted, asks
the futures DB (``wait`` says None), while the others go on. The trainers are stand-ins here: a trainer dying in the
middle of a take, or restarting between two, is a fault a test cannot time on demand on a real actor; the real
calls run in every SDK test (tests/e2e/test_sdk_flags.py counts them, tests/e2e/test_faults.py kills a trainer)."""

from __future__ import annotations

import asyncio

from lilo.futures.store import FutureState
from serve.tinker.pushed_results import PushedResults


class Trainer:
    """Stands in for a trainer actor's handle: ``finished_for.remote`` answers with what ``answer`` is given next
    (a list of states, or an exception: the call failed), under its ``incarnation``."""

    def __init__(self) -> None:
        self.incarnation = "first"
        self._answers: asyncio.Queue = asyncio.Queue()
        self.finished_for = self

    def remote(self, subscriber: str, timeout_s: float) -> asyncio.Future:
        return asyncio.ensure_future(self._take())

    async def _take(self) -> tuple[str, list[FutureState]]:
        answer = await self._answers.get()
        if isinstance(answer, Exception):
            raise answer
        return self.incarnation, answer

    def answer(self, answer: list[FutureState] | Exception) -> None:
        self._answers.put_nowait(answer)


def done(request_id: int, tenant: str | None = None) -> FutureState:
    return FutureState(request_id, "completed", str(request_id).encode(), tenant=tenant)


async def waited(pushed: PushedResults, request_id: int, tenant: str | None = None) -> FutureState | None:
    return await pushed.wait(request_id, timeout_s=5, tenant=tenant)


def test_each_request_gets_its_own_trainers_push_and_only_its_tenant_sees_it():
    async def scenario():
        trainers = {"t1": Trainer(), "t2": Trainer()}
        pushed = PushedResults(trainers.__getitem__)
        pushed.submitted(1, "t1")
        pushed.submitted(2, "t2")
        pushed.submitted(3, "t2")
        waits = [asyncio.create_task(waited(pushed, 1)), asyncio.create_task(waited(pushed, 2, "team-a"))]
        trainers["t2"].answer([done(2, "team-a"), done(3, "team-b")])
        trainers["t1"].answer([done(1)])
        return await asyncio.gather(*waits), await waited(pushed, 3, "team-a"), await waited(pushed, 9)

    (first, second), other_tenants, unknown = asyncio.run(scenario())
    assert (first.request_id, first.result, second.request_id) == (1, b"1", 2)
    assert other_tenants is None and unknown is None  # the futures DB answers those (404 / its own lookup)


def test_what_waits_on_a_failed_or_restarted_trainer_asks_the_futures_db_and_the_rest_goes_on():
    async def scenario():
        trainers = {"t1": Trainer(), "t2": Trainer(), "t3": Trainer()}
        pushed = PushedResults(trainers.__getitem__)
        for request_id, trainer in ((1, "t1"), (2, "t1"), (3, "t2"), (4, "t3"), (5, "t3")):
            pushed.submitted(request_id, trainer)
        trainers["t1"].answer([done(1)])  # pushed before the trainer died: still answered here
        await asyncio.sleep(0.01)
        trainers["t1"].answer(RuntimeError("the trainer died"))
        trainers["t1"].answer(RuntimeError("the trainer died"))  # its second listener
        trainers["t3"].answer([done(4)])
        await asyncio.sleep(0.01)
        trainers["t3"].incarnation = "restarted"  # its subscriptions went with the old process
        trainers["t3"].answer([])
        await asyncio.sleep(0.01)
        pushed.submitted(6, "t2")
        pushed.forget(6)  # its hand-over failed: nothing waits for it here
        trainers["t2"].answer([done(3)])
        return [await waited(pushed, request_id) for request_id in range(1, 7)]

    states = asyncio.run(scenario())
    assert [state and state.request_id for state in states] == [1, None, 3, 4, None, None]
