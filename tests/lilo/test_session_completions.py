"""A sampling session's finished requests after a cursor (the SDK's retrieve_futures), on a real SQLite ledger and
a real PostgreSQL one (the ``ledger`` fixture): the
order writes finished them in, clones kept apart, pages that never split a write, one statement for many polls,
and the long polls parked on them (lilo.futures.session_waiter)."""

import asyncio

import pytest

from lilo.errors import GoneError, InvalidRequestError, NotFoundError
from lilo.futures.session_completions import CLONE_SPAN, SessionTarget, completions_after
from lilo.futures.session_waiter import SessionWaiter
from lilo.futures.store import Completion, FuturesStore, Submission


@pytest.fixture
def store(ledger, clock):
    opened = FuturesStore(ledger, clock=clock)
    yield opened
    opened.close()


def sample(store: FuturesStore, session: str, seq: int) -> int:
    return store.submit(Submission(session, "sample", {"seq": seq}, seq_id=seq, trainer="t0"))


def done(request_id: int, size: int = 10) -> Completion:
    return Completion.success(request_id, b"x" * size, kind="sample")


def poll(store: FuturesStore, target: SessionTarget, cursor: int) -> tuple[list, int]:
    return store.session_completions([(target, cursor)])[(target, cursor)]


def test_a_poll_gets_what_finished_after_its_cursor_in_write_order(store):
    a, b, c = (sample(store, "s", seq) for seq in (1, 2, 3))
    store.complete_many([done(c, 7), Completion.failure(a, "boom", kind="sample")])
    first, cursor = poll(store, SessionTarget("s"), 0)
    assert [(r.request_id, r.completed, r.result_bytes) for r in first] == [(a, False, 0), (c, True, 7)]
    assert [r.as_wire() for r in first] == [
        {"state": "failed", "request_id": str(a)},
        {"state": "finished", "request_id": str(c), "response_payload_uncompressed_size": 7}]
    assert poll(store, SessionTarget("s"), cursor) == ([], cursor)  # nothing new: the cursor stays
    store.complete_many([done(b)])
    second, later = poll(store, SessionTarget("s"), cursor)
    assert [r.request_id for r in second] == [b] and later > cursor


def test_clones_sessions_and_training_futures_stay_apart(store):
    original, clone = sample(store, "s", 5), sample(store, "s", 2 * CLONE_SPAN + 1)
    other = sample(store, "other", 5)
    training = store.submit(Submission("model", "forward_backward", {}, seq_id=1, trainer="t0"))
    store.complete_many([done(original), done(clone), done(other),
                         Completion.success(training, b"{}", kind="forward_backward")])
    assert [r.request_id for r in poll(store, SessionTarget("s", 0), 0)[0]] == [original]
    assert [r.request_id for r in poll(store, SessionTarget("s", 2), 0)[0]] == [clone]
    assert poll(store, SessionTarget("s", 1), 0)[0] == []


def test_many_polls_cost_one_statement(store):
    ids = {name: sample(store, name, 1) for name in ("a", "b", "c")}
    store.complete_many([done(request_id) for request_id in ids.values()])
    polls = [(SessionTarget(name), 0) for name in ids] + [(SessionTarget("a"), 10**6)]
    before = store.statements
    answers = store.session_completions(polls)
    assert store.statements == before + 1
    assert {target.sampling_session_id: [r.request_id for r in found]
            for (target, cursor), (found, _) in answers.items() if cursor == 0} == {k: [v] for k, v in ids.items()}
    assert answers[(SessionTarget("a"), 10**6)] == ([], 10**6)


def test_a_page_ends_between_writes_and_numbers_go_on_after_a_reopen(ledger, clock):
    store = FuturesStore(ledger, clock=clock)
    ids = [sample(store, "s", seq) for seq in range(1, 6)]
    store.complete_many([done(ids[0])])
    store.complete_many([done(request_id) for request_id in ids[1:4]])  # one write: one number
    store.complete_many([done(ids[4])])

    def after(cursor: int) -> tuple[list, int]:
        poll = (SessionTarget("s"), cursor)
        return completions_after(store._read, [poll], page=2, mark=store._reader.mark)[poll]

    found, cursor = after(0)
    assert [r.request_id for r in found] == ids[:4]  # the page of 2 runs to the end of the second write
    rest, end = after(cursor)
    assert [r.request_id for r in rest] == ids[4:]
    store.close()
    reopened = FuturesStore(ledger, clock=clock)
    late = sample(reopened, "s", 9)
    reopened.complete_many([done(late)])
    assert [r.request_id for r in poll(reopened, SessionTarget("s"), end)[0]] == [late]
    reopened.close()


def test_failures_of_an_evacuated_trainer_are_numbered_too(store):
    request_id = sample(store, "s", 1)
    store.evacuate("t0", "the trainer died")
    assert [(r.request_id, r.completed) for r in poll(store, SessionTarget("s"), 0)[0]] == [(request_id, False)]


def test_joining_a_session_counts_its_clients_for_its_tenant_only(store):
    store.add_session("sess", tenant="acme")
    store.add_sampling_session("sess:sample:0", "sess", "base", tenant="acme")
    assert [store.join_sampling_session("sess:sample:0", "acme") for _ in range(3)] == [1, 2, 3]
    with pytest.raises(NotFoundError):
        store.join_sampling_session("sess:sample:0", "globex")


def test_parked_polls_are_answered_by_one_statement_per_write(store):
    async def scenario():
        loop = asyncio.get_running_loop()
        waiter = SessionWaiter(lambda polls: loop.run_in_executor(None, store.session_completions, polls))
        ids = {name: sample(store, name, 1) for name in ("a", "b", "c")}
        idle = await waiter.wait(SessionTarget("a"), 0, timeout_s=0.2)
        assert idle == ([], 0)
        polls = [asyncio.create_task(waiter.wait(SessionTarget(name), 0, timeout_s=30)) for name in ids]
        await asyncio.sleep(0.2)
        asked = waiter.queries
        store.complete_many([done(request_id) for request_id in ids.values()])
        waiter.wake()
        answers = await asyncio.gather(*polls)
        assert waiter.queries == asked + 1
        assert [[r.request_id for r in found] for found, _ in answers] == [[ids[name]] for name in ids]
        # The clients poll again from the cursors they were given: no write since, so no statement until one.
        again = [asyncio.create_task(waiter.wait(SessionTarget(name), cursor, timeout_s=30))
                 for name, (_, cursor) in zip(ids, answers)]
        await asyncio.sleep(0.2)
        assert waiter.queries == asked + 1 and waiter.parked == 3
        late = sample(store, "b", 2)
        store.complete_many([done(late)])
        waiter.wake()
        found, _ = await again[1]
        assert [r.request_id for r in found] == [late] and waiter.queries == asked + 2
        for poll in again:
            poll.cancel()
        await waiter.close()

    asyncio.run(scenario())


def test_a_sample_to_cancel_names_its_trainer_while_it_is_pending(store):
    pending = store.submit(Submission("s", "sample", {"seq": 1}, seq_id=1, trainer="t0", tenant="acme"))
    assert store.sample_to_cancel(pending, "acme") == "t0"
    with pytest.raises(GoneError, match="another API key"):  # another tenant's: answered as retrieve_future does
        store.sample_to_cancel(pending, "globex")
    store.complete_many([done(pending)])
    assert store.sample_to_cancel(pending, "acme") is None  # finished: nothing to cancel
    training = store.submit(Submission("model", "forward_backward", {}, seq_id=1, trainer="t0", tenant="acme"))
    with pytest.raises(InvalidRequestError, match="not a sample"):
        store.sample_to_cancel(training, "acme")
