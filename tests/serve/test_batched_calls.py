"""An ingress's batched actor calls (serve.tinker.batched_calls): what is sent together, and that every caller gets
its own answer or its own error, whatever happens to the call. The actor is an asyncio function here (no Ray): what
is tested is the batching, and the real calls run in every SDK test."""

import asyncio

import pytest

from lilo.errors import ConflictError
from serve.tinker.batched_calls import BatchedCalls


class Receiver:
    """Stands in for an actor method that takes a list: records each call's items, answers after ``delay_s``."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.calls: list[list[int]] = []
        self.delay_s = delay_s

    async def send(self, items: list[int]) -> list:
        self.calls.append(list(items))
        await asyncio.sleep(self.delay_s)
        return [ConflictError(f"item {item} is refused") if item < 0 else item * 10 for item in items]


def test_a_lone_call_goes_at_once_and_those_made_meanwhile_go_together() -> None:
    async def scenario() -> list:
        receiver = Receiver()
        batched = BatchedCalls(receiver.send)
        first = asyncio.ensure_future(batched.call(1))
        await asyncio.sleep(0)  # the first call is in flight
        rest = [asyncio.ensure_future(batched.call(item)) for item in (2, 3, 4)]
        answers = await asyncio.gather(first, *rest)
        return [answers, receiver.calls]

    answers, calls = asyncio.run(scenario())
    assert answers == [10, 20, 30, 40]
    assert calls == [[1], [2, 3, 4]]


def test_below_the_limit_of_calls_in_flight_a_turns_items_go_at_once_and_together() -> None:
    async def scenario() -> list:
        receiver = Receiver(delay_s=0.05)
        batched = BatchedCalls(receiver.send, max_in_flight=2)
        first = asyncio.ensure_future(batched.call(1))
        await asyncio.sleep(0)  # the first call is in flight
        same_turn = [asyncio.ensure_future(batched.call(item)) for item in (2, 3)]
        await asyncio.sleep(0.01)
        sent_before_the_first_came_back = [list(call) for call in receiver.calls]
        first_done_then = first.done()
        at_the_limit = [asyncio.ensure_future(batched.call(item)) for item in (4, 5)]
        await asyncio.sleep(0.01)
        calls_at_the_limit = len(receiver.calls)
        answers = await asyncio.gather(first, *same_turn, *at_the_limit)
        return [answers, sent_before_the_first_came_back, first_done_then, calls_at_the_limit, receiver.calls]

    answers, early, first_done_then, calls_at_the_limit, calls = asyncio.run(scenario())
    assert answers == [10, 20, 30, 40, 50]
    assert early == [[1], [2, 3]] and not first_done_then  # the second call did not wait for the first
    assert calls_at_the_limit == 2  # two in flight: 4 and 5 waited for one of them to come back
    assert calls == [[1], [2, 3], [4, 5]]


def test_bursts_are_split_at_the_most_items_a_call() -> None:
    async def scenario() -> list:
        receiver = Receiver()
        batched = BatchedCalls(receiver.send, max_items=2)
        answers = await asyncio.gather(*(batched.call(item) for item in range(5)))
        return [answers, receiver.calls]

    answers, calls = asyncio.run(scenario())
    assert answers == [0, 10, 20, 30, 40]
    assert calls == [[0], [1, 2], [3, 4]]


def test_an_items_error_reaches_only_its_caller() -> None:
    async def scenario() -> list:
        batched = BatchedCalls(Receiver().send)
        return await asyncio.gather(*(batched.call(item) for item in (1, -2, 3)), return_exceptions=True)

    good, refused, other = asyncio.run(scenario())
    assert (good, other) == (10, 30)
    assert isinstance(refused, ConflictError) and "item -2 is refused" in str(refused)


@pytest.mark.parametrize("at_once", [False, True], ids=["the call fails", "sending raises"])
def test_a_failed_call_fails_each_of_its_items_and_the_next_call_still_goes(at_once: bool) -> None:
    """The second call fails: its actor died while answering, or (``at_once``) sending raised before anything left,
    as Ray raises for an actor that is gone."""
    failures = iter([None, RuntimeError("the actor died")])

    def send(items: list[int]) -> asyncio.Future:
        error = next(failures, None)
        if error is not None and at_once:
            raise error
        answered = asyncio.get_running_loop().create_future()
        if error is not None:
            asyncio.get_running_loop().call_later(0.01, answered.set_exception, error)
        else:
            asyncio.get_running_loop().call_later(0.01, answered.set_result, items)
        return answered

    async def scenario() -> list:
        batched = BatchedCalls(send)
        first = asyncio.ensure_future(batched.call(1))
        await asyncio.sleep(0)
        answers = await asyncio.gather(first, batched.call(2), batched.call(3), return_exceptions=True)
        return [answers, await batched.call(4)]

    (first, second, third), later = asyncio.run(scenario())
    assert first == 1
    assert [str(error) for error in (second, third)] == ["the actor died", "the actor died"]
    assert later == 4


def test_a_wrong_number_of_answers_fails_the_call_rather_than_leaving_a_caller_waiting() -> None:
    async def send(items: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        return items[:1]

    async def scenario() -> list:
        batched = BatchedCalls(send)
        first = asyncio.ensure_future(batched.call(1))
        await asyncio.sleep(0)
        return await asyncio.gather(first, batched.call(2), batched.call(3), return_exceptions=True)

    first, second, third = asyncio.run(scenario())
    assert first == 1
    assert all(isinstance(error, RuntimeError) and "1 answers came back for 2 requests" in str(error)
               for error in (second, third))


def test_a_caller_that_goes_away_leaves_the_others_answered() -> None:
    async def scenario() -> list:
        batched = BatchedCalls(Receiver().send)
        first = asyncio.ensure_future(batched.call(1))
        await asyncio.sleep(0)
        leaving, staying = asyncio.ensure_future(batched.call(2)), asyncio.ensure_future(batched.call(3))
        await asyncio.sleep(0)
        leaving.cancel()
        return [await first, await staying, leaving.cancelled()]

    assert asyncio.run(scenario()) == [10, 30, True]


def test_callers_waiting_when_the_ingress_stops_get_an_error() -> None:
    async def scenario() -> list:
        batched = BatchedCalls(Receiver(delay_s=10).send)
        first, second = asyncio.ensure_future(batched.call(1)), asyncio.ensure_future(batched.call(2))
        await asyncio.sleep(0.01)
        first.cancel()  # the replica stops: its requests' tasks are cancelled, and the call sending the next items
        await asyncio.sleep(0.01)
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__.endswith("_send_waiting"):
                task.cancel()
        return [first, *await asyncio.gather(second, return_exceptions=True)]

    first, second = asyncio.run(scenario())
    assert first.cancelled()
    assert isinstance(second, RuntimeError) and "stopped before answering" in str(second)
