"""Tenancy in the futures store and its waiter, on a real SQLite file: another tenant's model, session, sampling
session or future answers exactly as one that does not exist; records without a tenant are the local tenant's."""

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest

from lilo.errors import GoneError, NotFoundError
from lilo.futures.store import Completion, FuturesStore, FutureState, Submission
from lilo.futures.waiter import FutureWaiter
from lilo.tenants import LOCAL_TENANT


@pytest.fixture
def store(tmp_path):
    opened = FuturesStore(tmp_path / "futures.db")
    opened.add_session("s-alpha", tenant="alpha")
    opened.add_model("s-alpha:train:0", "lilo/tiny-llama", {"rank": 4}, tenant="alpha", session_id="s-alpha",
                     trainer="lilo-trainer-0")
    opened.add_sampling_session("s-alpha:sample:0", "s-alpha", "lilo/tiny-llama", tenant="alpha")
    yield opened
    opened.close()


def message(call, *args) -> str:
    with pytest.raises(NotFoundError) as refused:
        call(*args)
    return str(refused.value)


def as_unknown(call, record_id: str, tenant: str) -> bool:
    """Whether ``call`` refuses ``tenant`` the record with the very message of a record that does not exist."""
    return message(call, record_id, tenant) == message(call, "nothing-here", tenant).replace("nothing-here", record_id)


def test_another_tenants_records_answer_as_unknown_ones(store):
    model, session, sampling = "s-alpha:train:0", "s-alpha", "s-alpha:sample:0"
    assert store.route(model, "alpha") == "lilo-trainer-0" and store.model(model, "alpha")["tenant"] == "alpha"
    assert all(as_unknown(call, model, "beta") for call in (store.route, store.model, store.training_run))
    assert store.trainer_of(model, "beta") is None and store.trainer_of(model, "alpha") == "lilo-trainer-0"
    assert as_unknown(store.check_session, session, "beta")
    store.check_session(session, "alpha")
    assert as_unknown(store.sampling_session, sampling, "beta")
    assert store.sampling_session(sampling, "alpha")["tenant"] == "alpha"
    # lilo itself (no tenant) sees everything.
    assert store.route(model) == "lilo-trainer-0"


def test_training_runs_list_only_the_callers_and_old_records_are_the_local_tenants(store):
    store.add_model("old:train:0", "lilo/tiny-llama", {"rank": 4})  # written before tenants existed
    assert [run["model_id"] for run in store.training_runs(None, 0, "alpha")[0]] == ["s-alpha:train:0"]
    runs, total = store.training_runs(None, 0, LOCAL_TENANT)
    assert ([run["model_id"] for run in runs], total) == (["old:train:0"], 1)
    assert store.training_runs(None, 0, "beta") == ([], 0)
    assert store.training_runs(None, 0)[1] == 2
    assert store.tenant_and_trainer_of("old:train:0") == (LOCAL_TENANT, None)
    assert store.tenant_and_trainer_of("s-alpha:train:0") == ("alpha", "lilo-trainer-0")
    assert store.tenant_and_trainer_of("s-alpha:sample:0") == ("alpha", None)
    assert store.tenant_and_trainer_of("nothing") == (None, None)


def test_a_submission_for_another_tenants_model_is_refused_before_a_retry_could_find_the_first(store):
    model = "s-alpha:train:0"
    first = store.submit(Submission(model, "optim_step", {"lr": 1}, seq_id=1, tenant="alpha"))
    # The same seq and payload from another tenant would be a retry of alpha's: it must not get alpha's id.
    outcomes = store.submit_many([
        Submission(model, "optim_step", {"lr": 1}, seq_id=1, tenant="beta"),
        Submission(model, "optim_step", {"lr": 1}, seq_id=2, tenant="beta"),
        Submission("s-alpha:sample:0", "sample", {"n": 1}, seq_id=0, tenant="beta"),
        Submission(model, "optim_step", {"lr": 1}, seq_id=1, tenant="alpha"),
    ])
    unknown_model = message(store.route, model, "beta")
    assert [str(outcome.error) for outcome in outcomes[:2]] == [unknown_model] * 2
    assert str(outcomes[2].error) == message(store.sampling_session, "s-alpha:sample:0", "beta")
    assert (outcomes[3].request_id, outcomes[3].duplicate) == (first, True)
    assert store.highest_request_id() == first  # nothing of beta's was recorded


def test_another_tenants_future_is_looked_up_exactly_as_a_missing_one(store):
    request_id = store.submit(Submission("s-alpha:train:0", "optim_step", {"lr": 1}, seq_id=1, tenant="alpha"))
    store.complete_many([Completion.success(request_id, b"r")])
    assert store.lookup(request_id, "alpha").result == b"r"
    with pytest.raises(GoneError) as foreign:
        store.lookup(request_id, "beta")
    assert str(foreign.value) == str(store.missing_error(request_id))
    assert store.tenants_of([request_id, 999]) == {request_id: "alpha"}


def test_the_waiter_hands_a_result_only_to_its_own_tenant(store):
    ids = [store.submit(Submission("s-alpha:train:0", "optim_step", {"lr": i}, seq_id=i, tenant="alpha"))
           for i in (1, 2)]

    async def scenario():
        with ThreadPoolExecutor(1) as db:
            loop = asyncio.get_running_loop()

            async def fetch(wanted):
                return await loop.run_in_executor(db, store.states, wanted)

            async def missing(request_id):
                return await loop.run_in_executor(db, store.missing_error, request_id)

            waiter = FutureWaiter(fetch, tick_s=0.02, missing=missing)
            # Pending: another tenant is answered at the first tick as for a missing id, not left to wait.
            with pytest.raises(GoneError) as pending_foreign:
                await waiter.wait(ids[0], timeout_s=5, tenant="beta")
            own = asyncio.create_task(waiter.wait(ids[0], timeout_s=5, tenant="alpha"))
            foreign = asyncio.create_task(waiter.wait(ids[0], timeout_s=5, tenant="beta"))
            await asyncio.sleep(0)
            await loop.run_in_executor(db, store.complete_many, [Completion.success(ids[0], b"mine")])
            waiter.notify(FutureState(ids[0], "completed", b"mine", tenant="alpha"))
            # A remembered result goes to its tenant at once; another tenant still finds nothing.
            remembered = await waiter.wait(ids[0], timeout_s=5, tenant="alpha")
            with pytest.raises(GoneError) as remembered_foreign:
                await waiter.wait(ids[0], timeout_s=5, tenant="beta")
            with pytest.raises(GoneError):
                await foreign
            await waiter.close()
            return await own, remembered, pending_foreign.value, remembered_foreign.value

    own, remembered, *refusals = asyncio.run(scenario())
    assert own.result == remembered.result == b"mine"
    assert {str(refusal) for refusal in refusals} == {str(store.missing_error(ids[0]))}


def test_an_older_file_gains_the_sampling_sessions_tenant_column(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE sampling_sessions (sampling_session_id VARCHAR PRIMARY KEY, session_id VARCHAR NOT "
                    "NULL, base_model VARCHAR NOT NULL, model_path VARCHAR, created_at FLOAT NOT NULL)")
        old.execute("INSERT INTO sampling_sessions VALUES ('s:sample:0', 's', 'lilo/tiny-llama', NULL, 1.0)")
    store = FuturesStore(path)
    try:
        assert store.sampling_session("s:sample:0", LOCAL_TENANT)["tenant"] is None
        assert as_unknown(store.sampling_session, "s:sample:0", "alpha")
    finally:
        store.close()
