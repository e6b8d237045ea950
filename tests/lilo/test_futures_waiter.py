"""FutureWaiter and GroupCommitter over a real store (SQLite and PostgreSQL: the ``ledger`` fixture), on a real event
loop."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from lilo.errors import NotFoundError
from lilo.futures.group_commit import GroupCommitter
from lilo.futures.store import Completion, FuturesStore, FutureState, Submission
from lilo.futures.waiter import FutureWaiter


@pytest.fixture
def store(ledger):
    opened = FuturesStore(ledger)
    yield opened
    opened.close()


def submit_pending(store, count: int) -> list[int]:
    return [o.request_id for o in store.submit_many(
        [Submission("m", "forward_backward", {"i": i}, seq_id=i) for i in range(count)])]


def waiter_for(store, executor, tick_s=0.02) -> FutureWaiter:
    async def fetch(ids):
        return await asyncio.get_running_loop().run_in_executor(executor, store.states, ids)
    return FutureWaiter(fetch, tick_s=tick_s)


def test_waiters_resolve_when_their_future_completes_elsewhere(store):
    ids = submit_pending(store, 3)

    async def scenario():
        with ThreadPoolExecutor(1) as db:
            waiter = waiter_for(store, db)
            waits = [asyncio.create_task(waiter.wait(i, timeout_s=10)) for i in ids]
            await asyncio.sleep(0.1)
            await asyncio.get_running_loop().run_in_executor(db, store.complete_many, [
                Completion.success(ids[0], b"a"), Completion.failure(ids[1], "bad", "user"),
                Completion.success(ids[2], b"c")])
            return await asyncio.gather(*waits)

    states = asyncio.run(scenario())
    assert [(s.status, s.result, s.error) for s in states] == [
        ("completed", b"a", None), ("failed", None, "bad"), ("completed", b"c", None)]


def test_notify_resolves_without_a_query(store):
    (request_id,) = submit_pending(store, 1)

    async def scenario():
        async def fetch(ids):
            await asyncio.sleep(0)
            return store.states(ids)
        waiter = FutureWaiter(fetch, tick_s=60)
        task = asyncio.create_task(waiter.wait(request_id, timeout_s=5))
        await asyncio.sleep(0.05)
        before = store.statements  # the first tick ran before the notify; nothing after it may query
        waiter.notify(FutureState(request_id, "completed", b"r"))
        state = await task
        await waiter.close()
        return state, store.statements - before

    state, queries = asyncio.run(scenario())
    assert state.result == b"r"
    assert queries == 0


def test_an_expected_future_is_waited_for_without_queries_and_the_safety_net_finds_one_written_elsewhere(store):
    expected, elsewhere = submit_pending(store, 2)

    async def scenario():
        async def fetch(ids):
            return store.states(ids)
        # The safety net's period far beyond the idle window measured below, so a slow machine cannot fold one in.
        waiter = FutureWaiter(fetch, tick_s=0.01, expected_poll_s=2.0)
        waiter.expect(expected)
        waiter.expect(elsewhere)
        first = asyncio.create_task(waiter.wait(expected, timeout_s=5))
        await asyncio.sleep(0.05)  # the first poll (the safety net's) has run
        before = store.statements
        await asyncio.sleep(0.2)  # 20 ticks
        idle_queries = store.statements - before
        waiter.notify(FutureState(expected, "completed", b"mine"))
        state = await first
        # A result written without a notify (as the outbox's late write is) still reaches its waiter, within the
        # safety net's period.
        second = asyncio.create_task(waiter.wait(elsewhere, timeout_s=5))
        await asyncio.sleep(0.05)
        store.complete_many([Completion.success(elsewhere, b"late")])
        late = await asyncio.wait_for(second, 5.0)
        await waiter.close()
        return idle_queries, state, late

    idle_queries, state, late = asyncio.run(scenario())
    assert idle_queries == 0
    assert state.result == b"mine" and late.result == b"late"


def test_a_result_notified_before_anyone_asks_is_answered_at_once(store):
    ids = submit_pending(store, 3)

    async def scenario():
        async def fetch(ids):
            return store.states(ids)
        waiter = FutureWaiter(fetch, tick_s=60, recent=2)
        busy = asyncio.create_task(waiter.wait(ids[2], timeout_s=5))  # keeps the poller in its 60 s sleep
        await asyncio.sleep(0.05)
        for request_id in ids[:2]:
            waiter.notify(FutureState(request_id, "completed", str(request_id).encode()))
        before = store.statements
        state = await asyncio.wait_for(waiter.wait(ids[1], timeout_s=5), 1.0)  # no tick to wait for
        waiter.notify(FutureState(ids[2], "completed", b"x"))  # pushes ids[0] out of the two remembered
        await busy
        forgotten = asyncio.create_task(waiter.wait(ids[0], timeout_s=0.2))
        with pytest.raises(TimeoutError):
            await forgotten  # no longer remembered: it parks until the (60 s) tick
        await waiter.close()
        return state, store.statements - before

    state, queries = asyncio.run(scenario())
    assert state.result == str(state.request_id).encode()
    assert queries == 0


def test_a_waiter_times_out_and_several_waiters_share_one_id(store):
    ids = submit_pending(store, 2)

    async def scenario():
        with ThreadPoolExecutor(1) as db:
            waiter = waiter_for(store, db)
            with pytest.raises(TimeoutError):
                await waiter.wait(ids[0], timeout_s=0.1)
            assert waiter.parked == 0
            waits = [asyncio.create_task(waiter.wait(ids[1], timeout_s=10)) for _ in range(5)]
            await asyncio.sleep(0.05)
            await asyncio.get_running_loop().run_in_executor(db, store.complete_many,
                                                             [Completion.success(ids[1], b"x")])
            return await asyncio.gather(*waits)

    assert [s.result for s in asyncio.run(scenario())] == [b"x"] * 5


def queries_per_tick(store, waiters: int, ticks: int = 10) -> float:
    ids = submit_pending(store, waiters)
    tick_s = 0.05

    async def scenario():
        with ThreadPoolExecutor(1) as db:
            waiter = waiter_for(store, db, tick_s=tick_s)
            before = store.statements
            waits = [asyncio.create_task(waiter.wait(i, timeout_s=ticks * tick_s)) for i in ids]
            await asyncio.gather(*waits, return_exceptions=True)
            await waiter.close()
            return store.statements - before

    return asyncio.run(scenario()) / ticks


def test_one_query_per_tick_whatever_the_number_of_waiters(store):
    few = queries_per_tick(store, waiters=8)
    many = queries_per_tick(store, waiters=2048)  # the first 8 are those above again
    assert 0 < few <= 1.0
    assert 0 < many <= 1.0


def test_group_commit_shares_commits_and_keeps_arrival_order(store):
    async def scenario():
        with ThreadPoolExecutor(1) as db:
            async def commit(group):
                await asyncio.sleep(0.01)  # a commit takes a while: more submissions arrive meanwhile
                return await asyncio.get_running_loop().run_in_executor(db, store.submit_many, group)
            committer = GroupCommitter(commit)
            arrivals = []
            ids = {}

            async def client(name: str, steps: int):
                for seq in range(steps):
                    await asyncio.sleep(random.random() * 0.005)
                    arrivals.append((name, seq))
                    outcome = await committer.submit(Submission(name, "forward_backward", {"s": seq}, seq_id=seq))
                    ids[(name, seq)] = outcome.request_id

            await asyncio.gather(*(client(f"m{i}", 10) for i in range(16)))
            return arrivals, ids, committer.commits

    arrivals, ids, commits = asyncio.run(scenario())
    assert [ids[key] for key in arrivals] == sorted(ids.values()) == list(range(1, len(arrivals) + 1))
    assert commits < len(arrivals)


def test_a_waiter_on_an_id_with_no_row_gets_the_missing_error(store):
    async def scenario():
        with ThreadPoolExecutor(1) as db:
            async def fetch(ids):
                return await asyncio.get_running_loop().run_in_executor(db, store.states, ids)

            async def missing(request_id):
                return store.missing_error(request_id)

            waiter = FutureWaiter(fetch, tick_s=0.02, missing=missing)
            with pytest.raises(NotFoundError, match="Unknown request_id 42"):
                await waiter.wait(42, timeout_s=5)
            assert waiter.parked == 0

    asyncio.run(scenario())


def test_a_failing_poll_is_tried_again_after_a_pause_not_every_tick(store):
    (request_id,) = submit_pending(store, 1)
    store.complete_many([Completion.success(request_id, b"r")])
    asked: list[float] = []

    async def scenario():
        async def fetch(ids):  # the database away for the first two polls
            asked.append(asyncio.get_running_loop().time())
            if len(asked) <= 2:
                raise ConnectionError("the database is away")
            return store.states(ids)
        waiter = FutureWaiter(fetch, tick_s=0.01, retry_s=0.2)
        state = await waiter.wait(request_id, timeout_s=5)
        await waiter.close()
        return state

    assert asyncio.run(scenario()).result == b"r"
    assert len(asked) == 3 and all(later - earlier >= 0.2 for earlier, later in zip(asked, asked[1:]))
