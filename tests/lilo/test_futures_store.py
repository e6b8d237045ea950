"""The futures store on real SQLite files and a real PostgreSQL server (the ``ledger`` fixture runs each test on
both): codec, idempotent submits, metadata-only scans, completion retries, retention, the database path."""

import sqlite3
import struct
import threading

import numpy as np
import orjson
import psycopg
import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from benchmarks.postgres_server import NO_FSYNC, postgres_server
from helpers import SQLITE_ONLY

from lilo.errors import ConflictError, GoneError, InvalidRequestError, NotFoundError, UnavailableError
from lilo.futures import codec, paths
from lilo.futures.database import LedgerUnreachableError
from lilo.futures.store import Completion, FuturesStore, Submission, parse_request_id


@pytest.fixture
def store(ledger, clock):
    opened = FuturesStore(ledger, clock=clock, retry_base_s=0.02, busy_timeout_ms=50)
    yield opened
    opened.close()


def step(i: int, n_tokens: int = 64) -> dict:
    return {"data": [{"tokens": list(range(i, i + n_tokens)), "weights": [0.5 + j / 7 for j in range(n_tokens)]}],
            "loss_fn": "cross_entropy"}


class Statements:
    """Every SQL statement and commit the store's engine runs (SQLAlchemy events)."""

    def __init__(self, engine) -> None:
        self.sql: list[str] = []
        self.commits = 0
        event.listen(engine, "before_cursor_execute", lambda *args: self.sql.append(args[2]))
        event.listen(engine, "commit", self._commit)

    def _commit(self, *_args) -> None:
        self.commits += 1


# --- fingerprints (codec) -----------------------------------------------------------------------------------
PAYLOADS = [
    step(3),
    {"ints": [0, -1, 2**63 - 1, -(2**63), 7, 8, 9, 10], "floats": [0.1, -0.0, 1e308, 5e-324, 2.5, 3.5, 4.5, 6.5]},
    {"bools": [True, False] * 8, "mixed": [1, 2.0] * 8, "short": [1, 2], "nested": [[1] * 9, {"a": [2.5] * 9}]},
    {"text": "héllo", "none": None, "empty": [], "float_ints": [1.0, 2.0] * 8},
    [1.0] * 100,
]
# Each differs from the one before it in one value, one type, one length or one key: a retry that changed anything
# must not pass for the same request.
NEAR_MISSES = [
    ({"t": list(range(16))}, {"t": list(range(15)) + [16]}),
    ({"t": list(range(16))}, {"t": [float(i) for i in range(16)]}),
    ({"t": list(range(16))}, {"t": list(range(17))}),
    ({"w": [0.5] * 16}, {"v": [0.5] * 16}),
    ({"w": [0.1] * 16}, {"w": [0.1] * 15 + [0.1000001]}),
    ({"a": [1] * 8, "b": [2] * 8}, {"a": [2] * 8, "b": [1] * 8}),
    ({"t": np.arange(10, dtype=np.int32)}, {"t": np.arange(10, dtype=np.int64)}),
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_payload_always_encodes_to_the_same_bytes_whatever_its_key_order(payload):
    reordered = orjson.loads(orjson.dumps(payload))
    if isinstance(reordered, dict):
        reordered = dict(reversed(list(reordered.items())))
    assert codec.encode(payload) == codec.encode(reordered)


@pytest.mark.parametrize(("one", "other"), NEAR_MISSES)
def test_payloads_that_differ_anywhere_encode_differently(one, other):
    assert codec.encode(one) != codec.encode(other)


def test_token_and_float_arrays_are_packed_binary_not_json_numbers():
    payload = step(0, n_tokens=512)
    blob = codec.encode(payload)
    (length,) = struct.unpack_from("<I", blob, 4)
    skeleton = blob[8:8 + length].decode()
    assert "511" not in skeleton and "0.5" not in skeleton
    # Token ids fit int32; these weights need float64 to be kept exactly.
    assert len(blob) - 8 - length == 512 * 4 + 512 * 8
    assert len(blob) < len(orjson.dumps(payload))


def test_arrays_take_the_narrowest_exact_type():
    blob = codec.encode({"weights": [0.0, 1.0] * 256, "big": [2**40] * 16})
    (length,) = struct.unpack_from("<I", blob, 4)
    assert len(blob) - 8 - length == 512 * 4 + 16 * 8


# --- submit ---------------------------------------------------------------------------------------------------
def test_ids_follow_arrival_order_and_a_retry_returns_the_same_id(store):
    first = store.submit_many([Submission("m", "forward_backward", step(i), seq_id=i) for i in range(4)])
    assert [o.request_id for o in first] == [1, 2, 3, 4]
    retry = store.submit(Submission("m", "forward_backward", step(2), seq_id=2))
    assert retry == 3
    assert store.count_by_status() == {"pending": 4}


def test_same_seq_with_a_different_payload_is_a_conflict_naming_the_seq(store):
    store.submit(Submission("m", "forward_backward", step(0), seq_id=5))
    with pytest.raises(ConflictError, match="seq_id 5 of model 'm' was already submitted"):
        store.submit(Submission("m", "forward_backward", step(1), seq_id=5))


def test_copies_within_one_batch_are_retries_or_conflicts(store):
    outcomes = store.submit_many([
        Submission("m", "forward_backward", step(0), seq_id=0),
        Submission("m", "forward_backward", step(0), seq_id=0),
        Submission("m", "forward_backward", step(9), seq_id=0),
    ])
    assert (outcomes[0].request_id, outcomes[1].request_id, outcomes[1].duplicate) == (1, 1, True)
    assert isinstance(outcomes[2].error, ConflictError)


def test_a_retry_after_the_request_ran_is_still_recognised(store):
    request_id = store.submit(Submission("m", "forward_backward", step(0), seq_id=0))
    store.complete_many([Completion.success(request_id, b"ok")])
    assert store.submit(Submission("m", "forward_backward", step(0), seq_id=0)) == request_id
    with pytest.raises(ConflictError):
        store.submit(Submission("m", "forward_backward", step(1), seq_id=0))


def test_a_retry_of_a_pending_request_says_which_trainer_to_hand_it_to_again(store):
    (first,) = store.submit_many([Submission("m", "optim_step", {"lr": 1}, seq_id=3, trainer="lilo-trainer-1")])
    (retry,) = store.submit_many([Submission("m", "optim_step", {"lr": 1}, seq_id=3)])
    assert (retry.request_id, retry.duplicate, retry.pending, retry.trainer) == (
        first.request_id, True, True, "lilo-trainer-1")
    store.complete_many([Completion.success(first.request_id, b"ok")])
    (late,) = store.submit_many([Submission("m", "optim_step", {"lr": 1}, seq_id=3)])
    assert (late.request_id, late.duplicate, late.pending, late.trainer) == (first.request_id, True, False, None)


# --- the ledger keeps no payload -----------------------------------------------------------------------------
@SQLITE_ONLY  # reads the file's bytes
def test_the_file_records_a_fingerprint_never_the_payload(store):
    marker = [123456789] * 4096  # 16 KiB of one int32 in the packed encoding
    request_id = store.submit(Submission("m", "forward_backward", {"tokens": marker}, seq_id=0))
    store.complete_many([Completion.success(request_id, b"ok")])
    store.close()
    raw = b"".join(path.read_bytes() for path in store.path.parent.iterdir() if path.is_file())
    assert np.array(marker, dtype="<i4").tobytes()[:64] not in raw
    with sqlite3.connect(store.path) as connection:
        columns = {row[1] for row in connection.execute("PRAGMA table_info(futures)")}
        (fingerprint,) = connection.execute("SELECT payload_sha256 FROM futures").fetchone()
    assert "payload" not in columns and len(fingerprint) == 64


def test_an_old_file_is_read_and_written_as_a_ledger(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:  # the table as the payload-keeping releases made it
        old.execute("CREATE TABLE futures (request_id INTEGER PRIMARY KEY AUTOINCREMENT, model_id VARCHAR NOT NULL, "
                    "request_type VARCHAR NOT NULL, seq_id INTEGER, status VARCHAR NOT NULL, payload BLOB, "
                    "payload_sha256 VARCHAR(64) NOT NULL, result BLOB, error TEXT, error_category VARCHAR, "
                    "tenant VARCHAR, submitted_at FLOAT NOT NULL, finished_at FLOAT, trainer VARCHAR, "
                    "CONSTRAINT uq_futures_model_seq UNIQUE (model_id, seq_id))")
        old.execute("CREATE INDEX ix_futures_pending_scan ON futures (status, model_id, seq_id, request_id, "
                    "request_type)")
    reopened = FuturesStore(path)
    request_id = reopened.submit(Submission("m", "forward_backward", step(0), seq_id=0))
    reopened.complete_many([Completion.success(request_id, b"ok")])
    assert reopened.lookup(request_id).result == b"ok"
    assert reopened.lookup(request_id).kind == "forward_backward"
    reopened.close()
    with sqlite3.connect(path) as check:
        names = {row[0] for row in check.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        (payload, kind) = check.execute("SELECT payload, kind FROM futures").fetchone()
    # Its payload column is left unread, its scheduler index dropped, request_type is called kind.
    assert "ix_futures_pending_scan" not in names and payload is None and kind == "forward_backward"


def test_create_missing_indexes_backfills_an_old_database(tmp_path):
    path = tmp_path / "old.db"
    FuturesStore(path).close()
    with sqlite3.connect(path) as old:
        old.execute("DROP INDEX ix_futures_status_trainer")
    reopened = FuturesStore(path)
    with sqlite3.connect(path) as check:
        names = {row[0] for row in check.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "ix_futures_status_trainer" in names
    assert reopened.create_missing_indexes() == []


def test_create_missing_columns_backfills_an_old_models_table(tmp_path):
    path = tmp_path / "old.db"
    FuturesStore(path).close()
    with sqlite3.connect(path) as old:
        old.execute("ALTER TABLE models DROP COLUMN unloaded_at")
        old.execute("ALTER TABLE models DROP COLUMN unloaded_reason")
        old.execute("ALTER TABLE models DROP COLUMN user_metadata")
        old.execute("INSERT INTO models (model_id, base_model, lora_config, created_at) VALUES ('m', 'b', '{}', 1)")
    reopened = FuturesStore(path)
    assert reopened.model("m")["unloaded_at"] is None and reopened.model("m")["user_metadata"] is None
    assert reopened.model("m")["unloaded_reason"] is None
    assert reopened.create_missing_columns() == []


# --- completion -----------------------------------------------------------------------------------------------
def test_completions_update_by_primary_key_in_one_transaction(store):
    ids = [store.submit(Submission("m", "forward_backward", step(i), seq_id=i)) for i in range(5)]
    statements = Statements(store.engine)
    assert store.complete_many([Completion.success(i, b"r%d" % i) for i in ids[:4]] +
                               [Completion.failure(ids[4], "out of memory", "server")])
    assert statements.commits == 1
    assert all("WHERE futures.request_id = " in sql for sql in statements.sql if sql.startswith("UPDATE"))
    states = store.states(ids)
    assert [states[i].status for i in ids] == ["completed"] * 4 + ["failed"]
    assert (states[ids[4]].error, states[ids[4]].category) == ("out of memory", "server")


def hold_write_lock(store: FuturesStore) -> sqlite3.Connection | psycopg.Connection:
    """Another process's connection that holds the lock the store's writes need, until it rolls back."""
    if store.path is not None:
        blocker = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
        return blocker
    blocker = psycopg.connect(store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False))
    blocker.execute("LOCK TABLE futures IN EXCLUSIVE MODE")  # reads go on; UPDATE waits for its lock_timeout
    return blocker


def test_a_held_write_lock_delays_completions_but_loses_none(store):
    ids = [store.submit(Submission("m", "forward_backward", step(i), seq_id=i)) for i in range(20)]
    blocker = hold_write_lock(store)
    threading.Timer(0.3, blocker.rollback).start()
    assert store.complete_many([Completion.success(i, b"done") for i in ids])
    blocker.close()
    assert store.count_by_status() == {"completed": 20}


def test_completions_that_exhaust_their_retries_wait_in_the_outbox(store, caplog):
    ids = [store.submit(Submission("m", "forward_backward", step(i), seq_id=i)) for i in range(3)]
    blocker = hold_write_lock(store)
    assert not store.complete_many([Completion.success(i, b"done") for i in ids])
    assert store.outbox_size == 3
    assert f"kept in the outbox for retry: {ids}" in caplog.text
    blocker.rollback()
    blocker.close()
    assert store.flush_outbox()
    assert store.outbox_size == 0 and store.count_by_status() == {"completed": 3}


def test_a_full_outbox_says_which_completion_it_lost(ledger, caplog):
    small = FuturesStore(ledger, retry_attempts=1, busy_timeout_ms=10, outbox_limit=2)
    ids = [small.submit(Submission("m", "forward_backward", step(i), seq_id=i)) for i in range(3)]
    blocker = hold_write_lock(small)
    small.complete_many([Completion.success(i, b"x") for i in ids])
    blocker.rollback()
    blocker.close()
    assert small.outbox_size == 2
    assert f"request {ids[0]} dropped" in caplog.text
    small.close()


def test_a_postgresql_ledger_away_for_a_while_keeps_completions_in_the_outbox_until_it_is_back():
    # Its own server, which it stops and starts again (the session's serves other tests meanwhile).
    with postgres_server(NO_FSYNC) as server:
        store = FuturesStore(server.create_database(), retry_attempts=2, retry_base_s=0.01)
        ids = [store.submit(Submission("m", "forward_backward", step(i), seq_id=i)) for i in range(3)]
        server.stop()
        assert not store.complete_many([Completion.success(i, b"done") for i in ids])  # retried, then kept
        assert store.outbox_size == 3
        with pytest.raises(OperationalError):  # the waiter's reader fails as the pool's connections do
            store.states(ids)
        server.start()
        assert store.flush_outbox() and store.outbox_size == 0
        assert [state.status for state in store.states(ids).values()] == ["completed"] * 3  # its reader reconnected
        store.close()


# --- retrieval and retention ----------------------------------------------------------------------------------
def test_unknown_pruned_and_malformed_ids_are_distinct_errors(store, clock):
    request_id = store.submit(Submission("m", "forward_backward", step(0), seq_id=0))
    store.complete_many([Completion.success(request_id, b"r")])
    assert store.lookup(request_id).result == b"r"
    clock.now += store.retention_s + 1
    assert store.prune() == 1
    with pytest.raises(GoneError, match="was pruned"):
        store.lookup(request_id)
    with pytest.raises(NotFoundError, match="Unknown request_id 99"):
        store.lookup(99)
    with pytest.raises(InvalidRequestError, match="not a request id"):
        parse_request_id("fut-abc")


def test_pending_futures_are_never_pruned(store, clock):
    request_id = store.submit(Submission("m", "forward_backward", step(0), seq_id=0))
    clock.now += 10 * store.retention_s
    assert store.prune() == 0
    assert store.lookup(request_id).status == "pending"


@SQLITE_ONLY  # measures the file (PostgreSQL's autovacuum keeps its database bounded on its own schedule)
def test_the_file_stays_bounded_in_a_long_run(store, clock):
    def one_hour(hour: int) -> None:
        ids = [o.request_id for o in store.submit_many(
            [Submission(f"m{i % 4}", "forward_backward", step(i, 512), seq_id=hour * 1000 + i) for i in range(64)])]
        store.complete_many([Completion.success(i, b"x" * 2048) for i in ids])
        clock.now += 3600
        store.prune()

    for hour in range(30):
        one_hour(hour)
    size_after_a_day = store.path.stat().st_size
    for hour in range(30, 90):
        one_hour(hour)
    assert store.path.stat().st_size <= size_after_a_day * 1.2
    assert store.count_by_status()["completed"] <= 64 * 25


# --- the file -------------------------------------------------------------------------------------------------
@SQLITE_ONLY  # SQLite's settings
def test_the_database_runs_wal_with_synchronous_normal_and_a_busy_timeout(store):
    with store.engine.connect() as connection:
        pragma = lambda name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
        assert pragma("journal_mode") == "wal"
        assert pragma("synchronous") == 1  # NORMAL
        assert pragma("busy_timeout") == 50


def test_a_postgresql_ledger_that_does_not_answer_is_named_without_its_password(postgres):
    for url in ("postgresql://lilo:s3cret@127.0.0.1:1/lilo", postgres.url("no_such_database", password="s3cret")):
        with pytest.raises(LedgerUnreachableError, match="cannot be reached .* Check that PostgreSQL runs") as refused:
            FuturesStore(url)
        assert "s3cret" not in str(refused.value) and ":***@127.0.0.1:" in str(refused.value)


def test_parent_directories_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "futures.db"
    FuturesStore(path).close()
    assert path.exists()


def test_filesystem_type_reads_the_longest_mount(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\nfuse /home/x/s3 fuse.s3fs rw 0 0\n")
    assert paths.filesystem_type(tmp_path.__class__("/home/u/db"), mounts) == "nfs4"
    assert paths.filesystem_type(tmp_path.__class__("/home/x/s3/db"), mounts) == "fuse.s3fs"
    assert paths.filesystem_type(tmp_path.__class__("/var/db"), mounts) == "ext4"
    assert paths.is_network_filesystem("nfs4") and paths.is_network_filesystem("fuse.s3fs")
    assert not paths.is_network_filesystem("ext4")


def test_a_database_on_a_network_filesystem_is_warned_about(tmp_path, monkeypatch, caplog):
    # No NFS server can be mounted here; the mount table is the one thing faked.
    mounts = tmp_path / "mounts"
    mounts.write_text(f"server:/export {tmp_path} nfs4 rw 0 0\n")
    real = paths.filesystem_type
    monkeypatch.setattr(paths, "filesystem_type", lambda path: real(path, mounts))
    paths.prepare_db_path(tmp_path / "futures.db")
    assert "is on a nfs4 filesystem" in caplog.text


def test_a_sessions_models_and_those_of_sessions_idle_too_long_are_found(store, clock):
    store.add_session("busy", tenant="t")
    store.add_session("idle", tenant="t")
    for model_id, session_id in (("busy:train:0", "busy"), ("idle:train:0", "idle"), ("idle:train:1", "idle")):
        store.add_model(model_id, "base", {"rank": 4}, tenant="t", session_id=session_id, trainer="trainer-0")
    store.mark_unloaded("idle:train:1")
    assert store.session_models("idle", "t") == ["idle:train:0"]
    assert store.session_models("idle", "someone-else") == []  # another tenant's session has none of theirs
    clock.now += 100
    store.record_heartbeats({"busy": clock.now - 1})
    assert store.idle_session_models(60) == [("idle:train:0", "t", "idle")]
    assert store.idle_session_models(120) == []


def test_models_sessions_and_sampling_sessions_round_trip(store):
    store.add_session("s1", tenant="t", info={"tags": ["a"]})
    store.check_session("s1", "t")
    with pytest.raises(NotFoundError, match="Unknown session_id 'nope'"):
        store.check_session("nope", "t")
    store.record_heartbeats({"s1": 123.0, "nope": 124.0})  # a session that is gone is skipped
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT session_id, last_heartbeat_at FROM sessions").all() == [("s1", 123.0)]
    store.add_model("s1:train:0", "lilo/tiny-llama", {"rank": 4}, tenant="t", session_id="s1")
    assert store.trainer_of("s1:train:0") is None and store.trainer_of("ghost") is None
    store.place_model("s1:train:0", "lilo-trainer-1")
    assert store.trainer_of("s1:train:0") == "lilo-trainer-1"
    assert store.model("s1:train:0")["lora_config"] == {"rank": 4}
    store.add_sampling_session("samp-1", "s1", "lilo/tiny-llama", model_path="tinker://s1:train:0/sampler_weights/x")
    assert store.sampling_session("samp-1")["model_path"] == "tinker://s1:train:0/sampler_weights/x"
    with pytest.raises(NotFoundError, match="Unknown sampling session 'samp-2'"):
        store.sampling_session("samp-2")


def test_a_retried_sampling_session_is_the_same_one_and_a_different_one_is_a_conflict(store):
    path = "tinker://s1:train:0/sampler_weights/x"
    store.add_sampling_session("s1:sample:0", "s1", "lilo/tiny-llama", model_path=path)
    store.add_sampling_session("s1:sample:0", "s1", "lilo/tiny-llama", model_path=path)
    assert store.sampling_session("s1:sample:0")["model_path"] == path
    with pytest.raises(ConflictError, match="already exists"):
        store.add_sampling_session("s1:sample:0", "s1", "lilo/tiny-llama")


def test_an_unloaded_model_is_refused_by_route_and_left_out_of_placement_but_stays_a_run(store):
    store.add_model("s1:train:0", "lilo/tiny-llama", {"rank": 4}, trainer="lilo-trainer-0")
    assert store.route("s1:train:0") == "lilo-trainer-0"
    with pytest.raises(NotFoundError, match="Unknown model_id 'ghost'"):
        store.route("ghost")
    store.mark_unloaded("s1:train:0")
    with pytest.raises(GoneError, match="'s1:train:0' was unloaded"):
        store.route("s1:train:0")
    assert store.placement() == {}
    assert store.trainer_of("s1:train:0") == "lilo-trainer-0"  # its checkpoints are still where it was
    runs, total = store.training_runs(limit=10)
    assert total == 1 and runs[0]["unloaded_at"] is not None


def test_training_runs_page_newest_first_with_the_latest_request_time(store, clock):
    for n in range(3):
        clock.now += 1
        store.add_model(f"s:train:{n}", "lilo/tiny-llama", {"rank": 4}, user_metadata={"n": str(n)})
    clock.now += 10
    store.submit(Submission("s:train:0", "optim_step", {}, seq_id=1))
    runs, total = store.training_runs(limit=2)
    assert total == 3 and [run["model_id"] for run in runs] == ["s:train:2", "s:train:1"]
    assert runs[0]["user_metadata"] == {"n": "2"} and runs[0]["last_request_time"] == runs[0]["created_at"]
    (oldest,), _ = store.training_runs(limit=2, offset=2)
    assert oldest["model_id"] == "s:train:0" and oldest["last_request_time"] == clock.now


# --- routing and a trainer's failure ------------------------------------------------------------------------
def test_a_routed_submission_goes_to_its_models_trainer_or_is_refused_unrecorded(store):
    store.add_model("m", "base", {"rank": 4}, trainer="trainer-1")
    store.add_model("gone", "base", {"rank": 4}, trainer="trainer-1")
    store.mark_unloaded("gone")
    placed, unknown, unloaded = store.submit_many([
        Submission("m", "forward_backward", step(1), seq_id=1, routed=True),
        Submission("nobody", "forward_backward", step(1), seq_id=1, routed=True),
        Submission("gone", "forward_backward", step(1), seq_id=1, routed=True)])
    assert placed.trainer == "trainer-1" and placed.error is None
    assert isinstance(unknown.error, NotFoundError) and unknown.request_id is None
    assert isinstance(unloaded.error, GoneError) and unloaded.request_id is None
    assert store.count_by_status() == {"pending": 1}  # the refused ones left nothing behind


def test_evacuating_a_trainer_fails_its_unfinished_requests_and_unplaces_its_models(store):
    store.add_model("a", "base", {"rank": 4}, trainer="trainer-1")
    store.add_model("b", "base", {"rank": 8}, trainer="trainer-2")
    created = store.submit(Submission("a", "create_model", {}, seq_id=0, trainer="trainer-1"))
    finished = store.submit(Submission("a", "forward_backward", step(1), seq_id=1, routed=True))
    store.complete_many([Completion.success(created, b"{}"), Completion.success(finished, b"ok")])
    in_flight = store.submit(Submission("a", "forward_backward", step(2), seq_id=2, routed=True))
    sample = store.submit(Submission("a:sample:0", "sample", {"prompt": [1]}, seq_id=0, trainer="trainer-1"))
    elsewhere = store.submit(Submission("b", "forward_backward", step(3), seq_id=1, routed=True))

    displaced, failed = store.evacuate("trainer-1", "trainer-1 died")

    assert [(m.model_id, m.base_model, m.lora_config, m.next_seq) for m in displaced] == [("a", "base", {"rank": 4}, 3)]
    assert sorted(state.request_id for state in failed) == sorted([in_flight, sample])
    states = store.states([finished, in_flight, sample, elsewhere])
    assert states[finished].status == "completed"  # what had finished stays as it was
    assert (states[in_flight].status, states[in_flight].error, states[in_flight].category) == (
        "failed", "trainer-1 died", "server")
    assert states[elsewhere].status == "pending"  # another trainer's request is untouched
    with pytest.raises(UnavailableError, match="being restored"):
        store.route("a")
    (refused,) = store.submit_many([Submission("a", "forward_backward", step(4), seq_id=3, routed=True)])
    assert isinstance(refused.error, UnavailableError)
    store.place_model("a", "trainer-2")
    assert store.route("a") == "trainer-2"


def test_a_model_whose_futures_were_pruned_is_displaced_with_the_seq_after_them(store, clock):
    # A client idle past the retention time (its heartbeats keep its session) sends its next step with the seq
    # after its last one; a restore that forgot it would wait for seq 1 forever, and skip the checkpoint.
    for model_id in ("old", "mixed"):
        store.add_model(model_id, "base", {"rank": 4}, trainer="trainer-1")
    done = store.submit_many([Submission("old", "forward_backward", step(seq), seq_id=seq, routed=True)
                              for seq in range(4)] +
                             [Submission("mixed", "forward_backward", step(seq), seq_id=seq, routed=True)
                              for seq in range(2)])
    store.complete_many([Completion.success(outcome.request_id, b"ok") for outcome in done])
    clock.now += store.retention_s + 1
    store.submit(Submission("mixed", "forward_backward", step(9), seq_id=2, routed=True))
    assert store.prune() == 6
    displaced, _ = store.evacuate("trainer-1", "trainer-1 died")
    assert sorted((m.model_id, m.next_seq) for m in displaced) == [("mixed", 3), ("old", 4)]


def test_strays_are_the_models_on_none_of_the_trainers_now_and_are_evacuated_alike(store):
    store.add_model("kept", "base", {"rank": 4}, trainer="trainer-0")
    store.add_model("left-behind", "base", {"rank": 4}, trainer="trainer-1")  # a previous run had trainer-1
    store.add_model("half-restored", "base", {"rank": 8}, trainer="trainer-0")
    store.evacuate("trainer-0", "trainer-0 died")
    store.place_model("kept", "trainer-0")  # restored; "half-restored" was not when the recovery actor died
    store.add_model("unloaded", "base", {"rank": 4}, trainer="trainer-1")
    store.mark_unloaded("unloaded")
    kept = store.submit(Submission("kept", "forward_backward", step(1), seq_id=4, routed=True))
    lost = store.submit(Submission("left-behind", "forward_backward", step(1), seq_id=6, routed=True))

    displaced, failed = store.evacuate_strays(["trainer-0"], "its trainer is gone")

    assert sorted((m.model_id, m.next_seq) for m in displaced) == [("half-restored", None), ("left-behind", 7)]
    assert [state.request_id for state in failed] == [lost]
    states = store.states([kept, lost])
    assert states[kept].status == "pending" and (states[lost].status, states[lost].error) == (
        "failed", "its trainer is gone")
    assert store.placement() == {"kept": "trainer-0", "left-behind": None, "half-restored": None}


def test_displaced_models_come_most_recently_used_first(store, clock):
    for model_id in ("idle", "busy", "new"):
        store.add_model(model_id, "base", {"rank": 4}, trainer="trainer-1")
    for model_id in ("busy", "idle", "busy"):  # busy's latest request is the latest of all
        clock.now += 1
        store.submit(Submission(model_id, "forward_backward", step(int(clock.now)), seq_id=int(clock.now), routed=True))
    displaced, _ = store.evacuate("trainer-1", "trainer-1 died")
    assert [m.model_id for m in displaced] == ["busy", "idle", "new"]  # "new" never sent a request


def test_a_model_the_service_unloads_itself_says_why_to_its_clients(store):
    store.add_model("m", "base", {"rank": 4}, trainer="trainer-0")
    store.mark_unloaded("m", "its base model 'base' is not served here any more.")
    with pytest.raises(GoneError, match="unloaded by the service: its base model 'base' is not served"):
        store.route("m")
    (refused,) = store.submit_many([Submission("m", "forward_backward", step(1), seq_id=1, routed=True)])
    assert "is not served here any more" in str(refused.error)
    assert store.model("m")["unloaded_reason"] == "its base model 'base' is not served here any more."


def test_at_service_start_whatever_a_previous_run_left_pending_fails_with_a_message(store):
    finished = store.submit(Submission("m", "forward_backward", step(1), seq_id=1))
    store.complete_many([Completion.success(finished, b"ok")])
    orphan = store.submit(Submission("m", "forward_backward", step(2), seq_id=2))
    assert store.fail_all_pending("the service stopped") == 1
    states = store.states([finished, orphan])
    assert states[finished].status == "completed"
    assert (states[orphan].status, states[orphan].error, states[orphan].category) == (
        "failed", "the service stopped", "server")
