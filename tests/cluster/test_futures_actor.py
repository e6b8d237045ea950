"""The futures DB actor on the real local cluster: the one writer, long-polls, and nothing lost to a crash, on a
SQLite file and (one test) on a PostgreSQL database."""

import time
import uuid

import pytest
import ray

from cluster.futures_actor import get_futures_actor
from helpers import eventually, wait_for_heartbeat
from lilo.errors import ConflictError, InvalidRequestError, NotFoundError, RateLimitedError
from lilo.futures.store import Completion, Submission


@pytest.fixture
def futures(ray_driver, local_cluster):
    name = f"lilo-futures-test-{uuid.uuid4().hex[:8]}"
    actor = get_futures_actor(str(local_cluster.home / f"{name}.db"), name=name)
    yield actor
    ray.kill(actor, no_restart=True)


def test_submit_complete_and_retrieve(futures):
    ids = [ray.get(futures.submit.remote(Submission("m", "forward_backward", {"s": i}, seq_id=i))) for i in range(3)]
    assert ids == sorted(ids)
    assert ray.get(futures.retrieve.remote(ids[0], timeout_s=0)).status == "pending"
    assert ray.get(futures.complete.remote([Completion.success(ids[0], b"r0")]))
    state = ray.get(futures.retrieve.remote(str(ids[0])))
    assert (state.status, state.result) == ("completed", b"r0")


def test_a_parked_retrieve_wakes_when_its_result_arrives(futures):
    request_id = ray.get(futures.submit.remote(Submission("m", "optim_step", {"lr": 1e-4}, seq_id=0)))
    started = time.monotonic()
    parked = futures.retrieve.remote(request_id, timeout_s=30)
    time.sleep(0.5)
    ray.get(futures.complete.remote([Completion.failure(request_id, "trainer lost", "server")]))
    state = ray.get(parked, timeout=30)
    assert (state.status, state.error, state.category) == ("failed", "trainer lost", "server")
    assert time.monotonic() - started < 10


def test_a_result_that_comes_after_its_future_failed_changes_nothing(futures):
    # A trainer taken for dead (its requests failed, its models restored elsewhere) may still report a result.
    ray.get(futures.add_model.remote("m-late", "lilo/tiny-llama", {"rank": 4}, trainer="lilo-trainer-late"))
    outcome = ray.get(futures.submit_once.remote(Submission("m-late", "optim_step", {"lr": 1}, seq_id=1, routed=True)))
    ray.get(futures.evacuate.remote("lilo-trainer-late", "trainer lost"))
    assert ray.get(futures.complete.remote([Completion.success(outcome.request_id, b"late")]))
    # A long-poll (answered from memory) and a lookup (from the file) both say what the file says.
    for timeout_s in (5, 0):
        state = ray.get(futures.retrieve.remote(outcome.request_id, timeout_s=timeout_s))
        assert (state.status, state.error) == ("failed", "trainer lost")


def test_results_are_pushed_to_the_replica_that_submitted_them_once_each(futures):
    # A result is pushed as it comes in, while it is written: to its replica, with its tenant, and only once (a
    # trainer writes a batch again when a call of it raised, and a late result finds its future failed already).
    ray.get(futures.add_model.remote("m-push", "lilo/tiny-llama", {"rank": 4}, trainer="lilo-trainer-push",
                                     tenant="team-a"))
    ids = [ray.get(futures.submit_once.remote(
        Submission("m-push", "optim_step", {"lr": seq}, seq_id=seq, tenant="team-a", routed=True),
        "replica-1")).request_id for seq in (1, 2)]
    assert ray.get(futures.complete.remote([Completion.success(ids[0], b"r1")]))
    assert ray.get(futures.complete.remote([Completion.success(ids[0], b"r1")]))  # written again
    ray.get(futures.evacuate.remote("lilo-trainer-push", "trainer lost"))
    assert ray.get(futures.complete.remote([Completion.success(ids[1], b"late")]))
    _, pushed = ray.get(futures.finished_for.remote("replica-1", 5))
    assert [(s.request_id, s.status, s.result, s.error, s.tenant) for s in pushed] == [
        (ids[0], "completed", b"r1", None, "team-a"), (ids[1], "failed", None, "trainer lost", "team-a")]
    assert ray.get(futures.finished_for.remote("replica-1", 0.2))[1] == []


def test_a_pushed_result_counts_as_finished_against_max_inflight_once(futures, tmp_path):
    # Pushed before it is written, a result's client may send its next request at once: the push counts it as
    # finished for the tenant's max_inflight, and its write does not count it a second time.
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text("[tenants.team-b]\nmax_inflight = 2\n")
    ray.get(futures.use_tenants_file.remote(str(tenants_file)))
    ray.get(futures.add_model.remote("m-count", "lilo/tiny-llama", {"rank": 4}, trainer="lilo-trainer-count",
                                     tenant="team-b"))

    def submit(seq: int) -> int:
        return ray.get(futures.submit_once.remote(
            Submission("m-count", "optim_step", {"lr": seq}, seq_id=seq, tenant="team-b", routed=True),
            "replica-1")).request_id

    first, _ = submit(1), submit(2)
    assert ray.get(futures.complete.remote([Completion.success(first, b"r1")]))  # pushed, then written
    submit(3)  # 2 in flight again: the limit
    with pytest.raises(RateLimitedError, match="has 2 requests in flight"):
        submit(4)


def test_a_long_poll_answers_pending_at_its_timeout(futures):
    request_id = ray.get(futures.submit.remote(Submission("m", "forward_backward", {}, seq_id=0)))
    assert ray.get(futures.retrieve.remote(request_id, timeout_s=0.3)).status == "pending"


def test_errors_cross_the_actor_boundary_with_their_types(futures):
    ray.get(futures.submit.remote(Submission("m", "forward_backward", {"a": 1}, seq_id=0)))
    with pytest.raises(ConflictError, match="seq_id 0"):
        ray.get(futures.submit.remote(Submission("m", "forward_backward", {"a": 2}, seq_id=0)))
    with pytest.raises(NotFoundError):
        ray.get(futures.retrieve.remote(10_000))
    with pytest.raises(InvalidRequestError):
        ray.get(futures.retrieve.remote("not-an-id"))


def test_placement_map_lives_with_the_actor(futures):
    ray.get(futures.add_model.remote("m-1", "lilo/tiny-llama", {"rank": 8}, tenant="t", session_id="s"))
    ray.get(futures.place_model.remote("m-1", "lilo-trainer-0"))
    assert ray.get(futures.placement.remote()) == {"m-1": "lilo-trainer-0"}
    with pytest.raises(NotFoundError):
        ray.get(futures.place_model.remote("nope", "lilo-trainer-0"))


def test_heartbeats_noted_by_the_api_are_written_in_the_background(futures):
    ray.get(futures.add_session.remote("s-alpha", tenant="alpha"))
    statements = ray.get(futures.stats.remote())["statements"]
    before = time.time()
    for _ in range(20):
        ray.get(futures.note_heartbeats.remote({"s-alpha": time.time()}))
    # None of them touched SQLite: beyond stats' own count query, at most one background write of the times.
    assert ray.get(futures.stats.remote())["statements"] - statements <= 2
    # Written within one maintenance interval (5 s).
    wait_for_heartbeat(ray.get(futures.stats.remote())["db_path"], "s-alpha", since=before)


def killed_and_restarted(futures) -> None:
    old_pid = ray.get(futures.stats.remote())["pid"]
    ray.kill(futures, no_restart=False)
    eventually(lambda: ray.get(futures.stats.remote(), timeout=10)["pid"] != old_pid,
               "the futures actor answering from a new process", timeout_s=60,
               ignoring=(ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                         ray.exceptions.GetTimeoutError))


def loses_nothing_it_acknowledged(futures, requests: int = 40) -> None:
    acknowledged = [
        ray.get(futures.submit.remote(Submission(f"m{i % 4}", "forward_backward", {"s": i}, seq_id=i)))
        for i in range(requests)
    ]
    ray.get(futures.complete.remote([Completion.success(acknowledged[0], b"done")]))
    killed_and_restarted(futures)
    assert [ray.get(futures.retrieve.remote(rid, 0)).status for rid in acknowledged[1:]] == \
        ["pending"] * len(acknowledged[1:])
    assert ray.get(futures.retrieve.remote(acknowledged[0])).result == b"done"
    # Ids go on after the highest ever allocated.
    assert ray.get(futures.submit.remote(Submission("m-after", "optim_step", {}, seq_id=0))) == acknowledged[-1] + 1


def test_a_killed_actor_restarts_and_loses_nothing_it_acknowledged(futures):
    loses_nothing_it_acknowledged(futures)


def test_an_actor_on_a_postgresql_ledger_restarts_and_loses_nothing_it_acknowledged(ray_driver, postgres):
    name = f"lilo-futures-test-{uuid.uuid4().hex[:8]}"
    futures = get_futures_actor(postgres.create_database(password="s3cret"), name=name)
    try:
        loses_nothing_it_acknowledged(futures, requests=8)
        stats = ray.get(futures.stats.remote())
        assert stats["db_path"].startswith("postgresql://postgres:***@127.0.0.1:") and stats["db_mb"] > 0
    finally:
        ray.kill(futures, no_restart=True)
