"""FinishedPushes (the futures DB's end of pushed results) on a real event loop: a result goes to the box of the
replica that submitted it and nowhere else, one take hands over everything pushed since the last, a take with
nothing pushed returns empty after its timeout, and a box nobody takes keeps only its newest results."""

import asyncio

from lilo.futures.pushes import FinishedPushes
from lilo.futures.store import Completion, FutureState


def done(request_id: int) -> FutureState:
    return FutureState(request_id, "completed", str(request_id).encode())


def test_results_go_to_the_replica_that_submitted_them_one_take_a_batch():
    async def scenario():
        pushes = FinishedPushes()
        for request_id, replica in ((1, "a"), (2, "a"), (3, "b")):
            pushes.subscribe(request_id, replica)
        waiting = asyncio.create_task(pushes.take("a", timeout_s=5))
        await asyncio.sleep(0.01)
        pushes.push(done(1))
        pushes.push(done(2))
        pushes.push(done(4))  # nobody subscribed: no box gets it
        first = await waiting
        # Pushed before the take: handed over at once. A result is pushed once (its subscription is used up).
        pushes.push(done(3))
        pushes.push(done(3))
        b = await asyncio.wait_for(pushes.take("b", timeout_s=5), 1.0)
        empty = await pushes.take("a", timeout_s=0.05)
        return first, b, empty

    first, b, empty = asyncio.run(scenario())
    assert [s.request_id for s in first] == [1, 2]  # both pushed before the waiting take ran again
    assert [s.request_id for s in b] == [3]
    assert empty == []


def test_a_box_nobody_takes_keeps_its_newest_results_and_subscriptions_are_bounded():
    async def scenario():
        pushes = FinishedPushes(max_subscribed=3, max_box=2)
        for request_id in range(1, 6):
            pushes.subscribe(request_id, "gone")
        for request_id in range(1, 6):
            pushes.push(done(request_id))
        return await pushes.take("gone", timeout_s=0.05)

    # Only the last 3 subscriptions were kept, and of their 3 results the box kept the newest 2.
    assert [s.request_id for s in asyncio.run(scenario())] == [4, 5]


def test_of_two_takes_waiting_one_gets_a_push_and_the_other_waits_for_the_next():
    # An ingress replica keeps two takes waiting (serve.tinker.pushed_results), so that a result written while one
    # brings a batch back finds the other already there.
    async def scenario():
        pushes = FinishedPushes()
        for request_id in (1, 2):
            pushes.subscribe(request_id, "a")
        takes = [asyncio.create_task(pushes.take("a", timeout_s=5)) for _ in range(2)]
        await asyncio.sleep(0.01)
        pushes.push(done(1))
        finished, waiting = await asyncio.wait(takes, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.01)
        still_waiting = len(waiting)
        pushes.push(done(2))
        second = await asyncio.wait_for(waiting.pop(), 1.0)
        return [s.request_id for s in finished.pop().result()], still_waiting, [s.request_id for s in second]

    first, still_waiting, second = asyncio.run(scenario())
    assert (first, still_waiting, second) == ([1], 1, [2])


def test_a_completion_is_pushed_with_the_tenant_it_was_subscribed_with_once():
    async def scenario():
        pushes = FinishedPushes()
        pushes.subscribe(1, "a", "team-a")
        pushes.push_completion(Completion.failure(1, "out of memory", "server", kind="forward"))
        pushes.push_completion(Completion.success(1, b"late"))
        pushes.push(done(1))  # the state as written, afterwards: pushed already
        pushes.push_completion(Completion.success(2, b"x"))  # nobody subscribed
        return await pushes.take("a", timeout_s=0.05)

    assert asyncio.run(scenario()) == [FutureState(1, "failed", None, "out of memory", "server", "forward", "team-a")]
