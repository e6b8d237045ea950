"""FuturesStore: the ledger behind every future, written by exactly one process (the futures DB actor): a SQLite file,
or a PostgreSQL database (``lilo.futures.database`` has what differs between them).

It records what the service needs to answer for a request, never the request itself: its metadata, its payload's
fingerprint (a retry with the same payload is the same request, another under the same seq a 409), and its result
or error; and the sessions, models, sampling sessions and heartbeats around them. Payloads travel to their trainer
directly, which orders them itself (lilo.engine.queues).

What keeps it off the critical path:
- submissions that arrive together share one commit, in arrival order (ids are allocated by one writer);
- completions are one UPDATE by primary key per request, one transaction per batch, retried on "database is
  locked" (PostgreSQL: a lock timeout, a connection lost or refused) and kept in a bounded outbox when they still
  cannot be written, never dropped silently;
- results are pruned after the retention time, so the file stays bounded in a long run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import orjson
from sqlalchemy import bindparam, cast, event, func, inspect, literal, null, select, true, tuple_, union_all, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from lilo.errors import ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, UnavailableError
from lilo.backend.provenance import RecordedSequence
from lilo.engine.commands import Kind
from lilo.futures import billing, codec, database, sequences
from lilo.futures.checkpoint_records import CheckpointRecords
from lilo.futures.custom_losses import CustomLossRecords
from lilo.futures.sequences import RecordedSample
from lilo.futures.session_completions import FinishedRequest, FinishOrder, SessionTarget, completions_after
from lilo.futures.session_queries import SessionQueries, unknown_session_error
from lilo.futures.paths import prepare_db_path
from lilo.futures.schema import (
    COMPLETED, FAILED, PENDING, RENAMED_COLUMNS, RETIRED_INDEXES, futures, metadata, models, sampling_sessions,
    sessions, tenant_usage,
)
from lilo.tenants import LOCAL_TENANT, may_see, tenant_of

logger = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 24 * 3600.0
USAGE_COLUMNS = ("train_tokens", "sample_tokens", "requests")
RETRY_ATTEMPTS = 6
RETRY_BASE_S = 1.0  # 1 + 2 + 4 + 8 + 16 + 32: about a minute before a batch goes to the outbox
OUTBOX_LIMIT = 100_000
# Under SQLite's compiled-in bound-parameter limit (32766 since 3.32; PostgreSQL's is 65535), with room for a few
# other parameters.
MAX_BOUND_PARAMS = 32_000
MAX_REQUEST_ID = (1 << 63) - 1  # SQLite's largest INTEGER, PostgreSQL's largest BIGINT


@dataclasses.dataclass(frozen=True)
class Submission:
    model_id: str
    kind: str
    payload: Any
    seq_id: int | None = None
    tenant: str | None = None
    # The trainer it is handed to, when the caller chose it (a sample, a model's creation)...
    trainer: str | None = None
    # ...or True: the store routes it, to the trainer its model is placed on (refusing an unknown, unloaded or
    # displaced model), in the transaction that records it, so no failure recovery can slip in between.
    routed: bool = False
    # What it counts against its tenant's tokens per minute (a forward pass's tokens; a sample's prompt and
    # completions).
    tokens: int = 0
    # Set by ``prepared()``, which drops the payload: its fingerprint, computed wherever the submission was built (an
    # ingress replica) rather than on the one writer's thread.
    payload_sha256: str | None = None
    # Its request's trace context from the ingress (``lilo.timing.traces``); None when traces are off.
    trace: tuple[tuple[str, str], ...] | None = None
    # What billing counts of it at submit (lilo.futures.billing): a training pass's tokens, a sample's prompt's.
    billed_tokens: int | None = None

    def prepared(self) -> "Submission":
        if self.payload_sha256 is not None:
            return self
        return dataclasses.replace(self, payload=None, payload_sha256=fingerprint(codec.encode(self.payload)))


@dataclasses.dataclass(frozen=True)
class SubmitOutcome:
    """The request id, new or (for an identical retry) existing, and the trainer a new one goes to; or the error
    that refused it (a conflict; for a routed submission, a model it cannot go to). A retry of a request still
    pending is ``pending``, with the trainer it went to: whoever recorded it may have failed before handing it over
    (an ingress killed, a client gone), so the retry hands it over again, and the trainer runs it once either way."""

    request_id: int | None
    duplicate: bool = False
    error: LiloError | None = None
    trainer: str | None = None  # for a retry, set only while the first is pending
    weight: float = 1.0  # its tenant's share of a busy trainer (the tenants file), for the trainer's scheduler

    @property
    def pending(self) -> bool:
        return self.duplicate and self.trainer is not None


@dataclasses.dataclass(frozen=True)
class DisplacedModel:
    """A model whose trainer failed, to be restored elsewhere; its client's next request carries ``next_seq``."""

    model_id: str
    base_model: str
    lora_config: dict
    next_seq: int | None  # None: every request it had was pruned, so the next seq is not known


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: int
    ok: bool
    result: bytes | None = None
    error: str | None = None
    category: str | None = None
    # Known to whoever ran the request; lets a waiter in the writer's process answer without reading the row.
    kind: str = ""
    # A sample taken with record_stability_info: its sequences, recorded with its result.
    recorded: RecordedSample | None = None
    # A sample's generated tokens, for billing (lilo.futures.billing).
    sampled_tokens: int | None = None

    @classmethod
    def success(cls, request_id: int, result: bytes, kind: str = "", recorded: RecordedSample | None = None,
                sampled_tokens: int | None = None) -> "Completion":
        return cls(request_id, True, result=result, kind=kind, recorded=recorded, sampled_tokens=sampled_tokens)

    @classmethod
    def failure(cls, request_id: int, error: str, category: str = "server", kind: str = "") -> "Completion":
        return cls(request_id, False, error=error, category=category, kind=kind)


@dataclasses.dataclass(frozen=True)
class FutureState:
    request_id: int
    status: str
    result: bytes | None = None
    error: str | None = None
    category: str | None = None
    kind: str = ""
    tenant: str | None = None  # the tenant that submitted it (None: the local one)

    @classmethod
    def of(cls, completion: Completion, tenant: str | None) -> "FutureState":
        """What ``completion`` makes of its future, ``tenant``'s."""
        return cls(completion.request_id, COMPLETED if completion.ok else FAILED, completion.result,
                   completion.error, completion.category, completion.kind, tenant)

    @property
    def finished(self) -> bool:
        return self.status != PENDING


def fingerprint(encoded_payload: bytes) -> str:
    return hashlib.sha256(encoded_payload).hexdigest()


def parse_request_id(raw: str | int) -> int:
    """The integer id behind a wire request id; a malformed one is the client's mistake."""
    try:
        request_id = int(raw)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"request_id {raw!r} is not a request id; pass the id a submission returned.") from None
    if not 1 <= request_id <= MAX_REQUEST_ID:  # a larger one would fail every SQLite query it joins
        raise InvalidRequestError(f"request_id {raw!r} is not a request id; ids are positive integers up to "
                                  f"{MAX_REQUEST_ID}.")
    return request_id


def chunks(items: Sequence, size: int = MAX_BOUND_PARAMS) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class FuturesStore:
    """The ledger at ``location``: a SQLite file's path, or a ``postgresql://`` URL (LedgerUnreachableError when
    it does not answer). ``path`` is the file (None for PostgreSQL); ``location`` says where it is, without a
    password."""

    def __init__(self, location: Path | str, *, retention_s: float = DEFAULT_RETENTION_S,
                 retry_attempts: int = RETRY_ATTEMPTS, retry_base_s: float = RETRY_BASE_S,
                 busy_timeout_ms: int = 5000, outbox_limit: int = OUTBOX_LIMIT,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = None if database.is_url(location) else prepare_db_path(Path(location))
        self.location = database.shown(location if self.path is None else self.path)
        self.retention_s = retention_s
        self._retry_attempts = retry_attempts
        self._retry_base_s = retry_base_s
        self._clock = clock
        self._sleep = sleep
        self._outbox: deque[Completion] = deque()
        self._outbox_limit = outbox_limit
        self.engine = database.open_engine(location if self.path is None else self.path, busy_timeout_ms)
        # Cheap always-on counters, so load on the file shows in stats and benchmarks.
        self.statements = self.commits = 0
        event.listen(self.engine, "before_cursor_execute", self._count_statement)
        event.listen(self.engine, "commit", self._count_commit)
        metadata.create_all(self.engine)
        self.rename_old_columns()
        self.create_missing_columns()
        self.create_missing_indexes()
        self.drop_retired_indexes()
        self.checkpoints = CheckpointRecords(self.engine, clock)
        self.sessions = SessionQueries(self.engine, clock)
        self.finish_order = FinishOrder(self.engine)
        self.custom_losses = CustomLossRecords(self.engine, clock)
        # The waiter's per-tick reads skip the pool (database.Reader), counted by hand since no SQLAlchemy event
        # sees them.
        self._reader = database.Reader(self.engine)
        self._insert_future = _INSERT_FUTURE.replace("?", self._reader.mark)

    def _count_statement(self, *_args: Any) -> None:
        self.statements += 1

    def _count_commit(self, *_args: Any) -> None:
        self.commits += 1

    def file_sizes_mb(self) -> tuple[float, float]:
        """(database, write-ahead log) sizes in MiB (PostgreSQL: the database's, and 0)."""
        return database.sizes_mb(self.engine, self.path)

    # --- schema --------------------------------------------------------------------------------------------
    def rename_old_columns(self) -> None:
        """Give an older file's columns their names now (before missing columns are added, which would otherwise
        add the new name beside the old)."""
        with self.engine.begin() as connection:
            for table, old, new in RENAMED_COLUMNS:
                existing = {column["name"] for column in inspect(connection).get_columns(table)}
                if old in existing and new not in existing:
                    connection.exec_driver_sql(f'ALTER TABLE "{table}" RENAME COLUMN "{old}" TO "{new}"')

    def create_missing_columns(self) -> list[str]:
        """Add declared columns a database file created before they existed lacks (only nullable ones are ever
        added to a table). Idempotent; returns ``table.column`` of those it added."""
        added = []
        with self.engine.begin() as connection:
            for table in metadata.tables.values():
                existing = {column["name"] for column in inspect(connection).get_columns(table.name)}
                for column in table.columns:
                    if column.name not in existing:
                        kind = column.type.compile(dialect=self.engine.dialect)
                        connection.exec_driver_sql(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}')
                        added.append(f"{table.name}.{column.name}")
        return added

    def create_missing_indexes(self) -> list[str]:
        """Add declared indexes a database file created before they existed lacks (create_all skips whole
        tables it finds). Idempotent; returns the names it created."""
        created = []
        existing_by_table = {table: {ix["name"] for ix in inspect(self.engine).get_indexes(table)}
                             for table in metadata.tables}
        with self.engine.begin() as connection:
            for table in metadata.tables.values():
                for index in table.indexes:
                    if index.name not in existing_by_table[table.name]:
                        index.create(connection)
                        created.append(index.name)
        return created

    def drop_retired_indexes(self) -> None:
        """Drop indexes an older file has that nothing reads any more (each would still cost every insert)."""
        with self.engine.begin() as connection:
            for name in RETIRED_INDEXES:
                connection.exec_driver_sql(f'DROP INDEX IF EXISTS "{name}"')

    # --- submit --------------------------------------------------------------------------------------------
    def submit_many(self, submissions: Sequence[Submission]) -> list[SubmitOutcome]:
        """Record submissions in one commit, allocating ids in the given (arrival) order.

        A submission whose (model_id, seq_id) is already taken returns that request's id when its payload is the
        same (a retry), and a ConflictError when it differs; the same holds between copies within one batch.
        """
        now = self._clock()
        submissions = [sub.prepared() for sub in submissions]
        prints = [sub.payload_sha256 for sub in submissions]
        outcomes: list[SubmitOutcome | None] = [None] * len(submissions)
        with self.engine.begin() as connection:
            records = self._records_of(connection, submissions)
            self._refuse_foreign(records, submissions, outcomes)
            taken = self._existing_keys(connection, submissions)
            first_copy: dict[tuple, int] = {}
            inserting: list[int] = []
            for i, sub in enumerate(submissions):
                key = (sub.model_id, sub.seq_id)
                if outcomes[i] is not None:  # refused above
                    continue
                if sub.seq_id is None:
                    inserting.append(i)
                elif key in taken:
                    request_id, known_print, pending_on = taken[key]
                    outcomes[i] = _same_or_conflict(sub, request_id, known_print, prints[i], pending_on)
                elif key not in first_copy:
                    first_copy[key] = i
                    inserting.append(i)
            trainers = self._route_new(records, submissions, inserting, outcomes)
            inserting = [i for i in inserting if outcomes[i] is None]
            if inserting:
                # The one writer allocates ids itself, consecutively in arrival order, so the whole group is a
                # single prepared INSERT run many times (no RETURNING round trip per row).
                first_id = database.allocate_request_ids(connection, len(inserting))
                rows = [(first_id + n, submissions[i].model_id, submissions[i].kind, submissions[i].seq_id,
                         PENDING, prints[i], submissions[i].tenant, now, trainers.get(i), submissions[i].billed_tokens)
                        for n, i in enumerate(inserting)]
                connection.exec_driver_sql(self._insert_future, rows)
                for n, i in enumerate(inserting):
                    outcomes[i] = SubmitOutcome(first_id + n, trainer=trainers.get(i))
        for i, sub in enumerate(submissions):
            if outcomes[i] is None:  # a later copy, within this batch, of a submission inserted above (or refused)
                first = first_copy[(sub.model_id, sub.seq_id)]
                refused = outcomes[first].error is not None and outcomes[first].request_id is None
                outcomes[i] = outcomes[first] if refused else _same_or_conflict(
                    sub, outcomes[first].request_id, prints[first], prints[i])
        return outcomes  # type: ignore[return-value]

    @staticmethod
    def _route_new(records: dict[str, _Record], submissions: Sequence[Submission], new: Sequence[int],
                   outcomes: list[SubmitOutcome | None]) -> dict[int, str | None]:
        """The trainer of each new submission (by index): the caller's choice, or for a routed one its model's
        placement, read in the recording transaction; a routed one that cannot go anywhere gets its error."""
        trainers: dict[int, str | None] = {}
        for i in new:
            sub = submissions[i]
            if not sub.routed:
                trainers[i] = sub.trainer
                continue
            record = records.get(sub.model_id)
            try:
                trainers[i] = _placed_trainer(sub.model_id, record if record and record.kind == "model" else None)
            except LiloError as error:
                outcomes[i] = SubmitOutcome(None, error=error)
        return trainers

    def submit(self, submission: Submission) -> int:
        (outcome,) = self.submit_many([submission])
        if outcome.error is not None:
            raise outcome.error
        return outcome.request_id  # type: ignore[return-value]

    @staticmethod
    def _records_of(connection, submissions: Sequence[Submission]) -> dict[str, _Record]:
        """The model or sampling session each submission names, where its tenant is checked or its model's placement
        is needed: one query for the whole group."""
        ids = sorted({sub.model_id for sub in submissions if sub.tenant is not None or sub.routed})
        records: dict[str, _Record] = {}
        for chunk in chunks(ids, MAX_BOUND_PARAMS // 2):
            records.update((row[0], _Record(*row[1:])) for row in connection.execute(_RECORDS_OF, {"ids": chunk}))
        return records

    @staticmethod
    def _refuse_foreign(records: dict[str, _Record], submissions: Sequence[Submission],
                        outcomes: list[SubmitOutcome | None]) -> None:
        """Refuse, as if it did not exist, each submission for another tenant's model or sampling session (before
        retries are matched: another tenant's retry must not find the first)."""
        for i, sub in enumerate(submissions):
            record = records.get(sub.model_id)
            if sub.tenant is not None and record is not None and not may_see(sub.tenant, record.tenant):
                error = unknown_model_error if record.kind == "model" else unknown_sampling_session_error
                outcomes[i] = SubmitOutcome(None, error=error(sub.model_id))

    @staticmethod
    def _existing_keys(connection, submissions: Sequence[Submission]) -> dict[tuple, tuple[int, str, str | None]]:
        """(request id, payload fingerprint, its trainer while it is pending) of each (model, seq) already taken."""
        keys = list({(sub.model_id, sub.seq_id) for sub in submissions if sub.seq_id is not None})
        taken: dict[tuple, tuple[int, str, str | None]] = {}
        for chunk in chunks(keys, MAX_BOUND_PARAMS // 2):
            for model_id, seq_id, request_id, known_print, status, trainer in connection.execute(
                    _EXISTING_KEYS, {"keys": chunk}):
                taken[(model_id, seq_id)] = (request_id, known_print, trainer if status == PENDING else None)
        return taken

    # --- reading ---------------------------------------------------------------------------------------------
    def _read(self, sql: str, params: tuple) -> list[tuple]:
        self.statements += 1
        return self._reader.read(sql, params)

    def _marks(self, count: int) -> str:
        return ",".join([self._reader.mark] * count)

    # --- completion ----------------------------------------------------------------------------------------
    def complete_many(self, completions: Sequence[Completion]) -> bool:
        """Write results in one transaction, retrying lock and pool timeouts with backoff.

        Completions that still cannot be written go to the outbox, retried first by the next call (or by
        ``flush_outbox``). Returns True when nothing is left in the outbox.
        """
        batch = [*self._outbox, *completions]
        self._outbox.clear()
        if not batch:
            return True
        delay = self._retry_base_s
        for attempt in range(1, self._retry_attempts + 1):
            try:
                self._write_completions(batch)
                return True
            except (DBAPIError, PoolTimeoutError) as error:
                if not _transient(error):
                    raise
                if attempt == self._retry_attempts:
                    self._to_outbox(batch, error)
                    return False
                logger.warning("completion write of %d result(s) failed (%s); retry %d/%d in %.2f s",
                               len(batch), _short(error), attempt, self._retry_attempts - 1, delay)
                self._sleep(delay)
                delay *= 2
        return False

    def flush_outbox(self) -> bool:
        return self.complete_many([])

    @property
    def outbox_size(self) -> int:
        return len(self._outbox)

    def _write_completions(self, batch: Sequence[Completion]) -> None:
        now = self._clock()
        finished_seq = self.finish_order.next()
        params = [{"rid": c.request_id, "status": COMPLETED if c.ok else FAILED, "result": c.result,
                   "error": c.error, "category": c.category, "sampled": c.sampled_tokens, "now": now,
                   "finished_seq": finished_seq} for c in batch]
        recorded = {c.request_id: c.recorded for c in batch if c.ok and c.recorded is not None}
        with self.engine.begin() as connection:
            connection.execute(_COMPLETE_FUTURE, params)
            if recorded:
                sequences.insert_records(connection, recorded, now)

    def _to_outbox(self, batch: Sequence[Completion], error: Exception) -> None:
        self._outbox.extend(batch)
        ids = [c.request_id for c in batch]
        logger.error("could not write %d completion(s) after %d attempts (%s); kept in the outbox for retry: %s",
                     len(batch), self._retry_attempts, _short(error), ids)
        while len(self._outbox) > self._outbox_limit:
            lost = self._outbox.popleft()
            logger.error("completion outbox full (%d): request %s dropped; its future stays pending until the "
                         "trainer resubmits it", self._outbox_limit, lost.request_id)

    # --- reading results -----------------------------------------------------------------------------------
    def states(self, request_ids: Sequence[int]) -> dict[int, FutureState]:
        """States of these ids (result bytes only for finished ones); ids with no row are absent."""
        found: dict[int, FutureState] = {}
        for chunk in chunks(list(request_ids)):
            for row in self._read(_STATES.format(marks=self._marks(len(chunk))), tuple(chunk)):
                found[row[0]] = FutureState(*row)
        return found

    def lookup(self, request_id: int, tenant: str | None = None) -> FutureState:
        """The state of one request; NotFoundError when it never existed, GoneError when it was pruned; another
        tenant's request is one that does not exist."""
        state = self.states([request_id]).get(request_id)
        if state is None or not may_see(tenant, state.tenant):
            raise self.missing_error(request_id)
        return state

    def tenants_of(self, request_ids: Sequence[int], pending: bool = False) -> dict[int, str | None]:
        """The tenant of each of these requests (ids without a row are absent; with ``pending``, so are those
        that have finished)."""
        query = _PENDING_TENANTS if pending else _TENANTS
        found: dict[int, str | None] = {}
        for chunk in chunks(list(request_ids)):
            found.update(self._read(query.format(marks=self._marks(len(chunk))), tuple(chunk)))
        return found

    def pending_by_tenant(self) -> dict[str, int]:
        """How many requests of each tenant are pending."""
        rows = self._read(f"SELECT tenant, COUNT(*) FROM futures WHERE status = '{PENDING}' GROUP BY tenant", ())
        counts: dict[str, int] = {}
        for tenant, count in rows:
            counts[tenant_of(tenant)] = counts.get(tenant_of(tenant), 0) + count
        return counts

    def add_usage(self, added: dict[str, dict[str, int]]) -> None:
        """Add tokens and requests to tenants' usage (``{tenant: {"train_tokens": .., "sample_tokens": ..,
        "requests": ..}}``)."""
        if not added:
            return
        rows = [{"tenant": tenant, **{column: counts.get(column, 0) for column in USAGE_COLUMNS}}
                for tenant, counts in added.items()]
        insert = database.insert(self.engine, tenant_usage)
        with self.engine.begin() as connection:
            connection.execute(insert.on_conflict_do_update(index_elements=["tenant"], set_={
                column: tenant_usage.c[column] + insert.excluded[column] for column in USAGE_COLUMNS}), rows)

    def usage(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """Each tenant's usage (only ``tenant``'s when given): tokens, requests, and the models it holds."""
        with self.engine.connect() as connection:
            query = select(tenant_usage)
            if tenant is not None:
                query = query.where(tenant_usage.c.tenant == tenant)
            found = {row["tenant"]: {column: row[column] for column in USAGE_COLUMNS}
                     for row in connection.execute(query).mappings()}
            held = connection.execute(select(func.coalesce(models.c.tenant, LOCAL_TENANT), func.count())
                                      .where(models.c.unloaded_at.is_(None), _owned_by(models, tenant))
                                      .group_by(func.coalesce(models.c.tenant, LOCAL_TENANT))).all()
        for owner, count in held:
            found.setdefault(owner, no_usage())["models"] = count
        for counts in found.values():
            counts.setdefault("models", 0)
        return found

    def loaded_models(self, tenant: str) -> int:
        """How many models ``tenant`` holds (created and not unloaded)."""
        with self.engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(models).where(
                models.c.unloaded_at.is_(None), _owned_by(models, tenant))).scalar_one()

    def missing_error(self, request_id: int) -> NotFoundError | GoneError:
        """What a request without a row (or another tenant's) answers."""
        if request_id <= self.highest_request_id():
            return GoneError(
                f"Request {request_id} finished more than {self.retention_s / 3600:.3g} h ago and its result was "
                "pruned, or it was sent with another API key; results are kept for the retention time only.")
        return NotFoundError(f"Unknown request_id {request_id}; pass an id that a submission returned.")

    def highest_request_id(self) -> int:
        with self.engine.connect() as connection:
            return self._highest_request_id(connection)

    @staticmethod
    def _highest_request_id(connection) -> int:
        return database.highest_request_id(connection)

    # --- retention -----------------------------------------------------------------------------------------
    def prune(self) -> int:
        """Delete finished futures older than the retention time; returns how many."""
        cutoff = self._clock() - self.retention_s
        old = futures.c.finished_at.is_not(None) & (futures.c.finished_at < cutoff)
        with self.engine.begin() as connection:
            highest = connection.execute(select(futures.c.model_id, func.max(futures.c.seq_id))
                                         .where(old, futures.c.seq_id >= 0).group_by(futures.c.model_id)).all()
            if highest:
                connection.execute(
                    update(models).where(models.c.model_id == bindparam("pruned_model"))
                    .values(pruned_seq=database.greatest(connection, func.coalesce(models.c.pruned_seq, -1),
                                                         bindparam("seq"))),
                    [{"pruned_model": model_id, "seq": seq} for model_id, seq in highest])
            deleted = connection.execute(futures.delete().where(old)).rowcount
            sequences.prune_expired(connection, self._clock())
        if deleted:
            database.after_prune(self.engine)
        return deleted

    def count_by_status(self) -> dict[str, int]:
        with self.engine.connect() as connection:
            rows = connection.execute(select(futures.c.status, func.count()).group_by(futures.c.status))
            return {status: count for status, count in rows}

    # --- models, placement, sessions -----------------------------------------------------------------------
    def add_model(self, model_id: str, base_model: str, lora_config: dict, *, tenant: str | None = None,
                  session_id: str | None = None, trainer: str | None = None,
                  user_metadata: dict[str, str] | None = None) -> None:
        with self.engine.begin() as connection:
            connection.execute(models.insert().values(
                model_id=model_id, tenant=tenant, session_id=session_id, base_model=base_model,
                lora_config=orjson.dumps(lora_config).decode(), trainer=trainer, created_at=self._clock(),
                user_metadata=None if user_metadata is None else orjson.dumps(user_metadata).decode()))

    def place_model(self, model_id: str, trainer: str) -> None:
        with self.engine.begin() as connection:
            placed = connection.execute(update(models).where(models.c.model_id == model_id).values(trainer=trainer))
            if placed.rowcount == 0:
                raise NotFoundError(f"Unknown model_id {model_id!r}; create the model first.")

    def placement(self, tenant: str | None = None) -> dict[str, str | None]:
        """model_id -> the trainer it lives on (None while unplaced), for every model not unloaded (``tenant``'s
        only, when given)."""
        with self.engine.connect() as connection:
            return dict(connection.execute(select(models.c.model_id, models.c.trainer).where(
                models.c.unloaded_at.is_(None), _owned_by(models, tenant))).all())

    def trainer_of(self, model_id: str, tenant: str | None = None) -> str | None:
        """The trainer one model lives on (None: unknown, unplaced or another tenant's): one row."""
        with self.engine.connect() as connection:
            row = connection.execute(select(models.c.trainer, models.c.tenant).where(
                models.c.model_id == model_id)).first()
        return row.trainer if row is not None and may_see(tenant, row.tenant) else None

    def tenant_and_trainer_of(self, record_id: str) -> tuple[str | None, str | None]:
        """(the tenant of the model or sampling session ``record_id``, None when there is none; the trainer
        it is a model on, else None)."""
        with self.engine.connect() as connection:
            row = connection.execute(select(models.c.tenant, models.c.trainer).where(
                models.c.model_id == record_id)).first()
            if row is None:
                row = connection.execute(select(sampling_sessions.c.tenant, literal(None)).where(
                    sampling_sessions.c.sampling_session_id == record_id)).first()
        return (None, None) if row is None else (tenant_of(row[0]), row[1])

    def route(self, model_id: str, tenant: str | None = None) -> str:
        """The trainer that takes new requests for a model; NotFoundError when unknown or another tenant's,
        GoneError once it was unloaded, UnavailableError while it is being restored elsewhere. One row."""
        with self.engine.connect() as connection:
            row = connection.execute(select(models.c.trainer, models.c.unloaded_at, models.c.unloaded_reason,
                                            models.c.tenant).where(
                models.c.model_id == model_id)).first()
        return _placed_trainer(model_id, row if row is not None and may_see(tenant, row.tenant) else None)

    def fail_all_pending(self, error: str) -> int:
        """Fail every pending request with ``error`` (at service start: no trainer holds them any more); returns
        how many."""
        with self.engine.begin() as connection:
            return connection.execute(update(futures).where(futures.c.status == PENDING).values(
                status=FAILED, error=error, error_category="server", finished_at=self._clock(),
                finished_seq=self.finish_order.next())).rowcount

    def evacuate(self, trainer: str, error: str) -> tuple[list[DisplacedModel], list[FutureState]]:
        """``trainer`` failed: in one transaction, take its models off it (routing answers 503 until each is
        placed again) and fail, with ``error``, every request handed to it that had not finished. Returns the
        models to restore, the most recently used first, and the futures failed."""
        return self._displace(models.c.trainer == trainer, futures.c.trainer == trainer, error)

    def evacuate_strays(self, trainers: Sequence[str], error: str) -> tuple[list[DisplacedModel], list[FutureState]]:
        """As ``evacuate``, for every model on none of ``trainers`` (the service's trainers now): on a trainer a
        previous run had and this one has not, or unplaced because a restore was cut short."""
        live = list(trainers)
        return self._displace(models.c.trainer.is_(None) | models.c.trainer.not_in(live),
                              futures.c.trainer.is_not(None) & futures.c.trainer.not_in(live), error)

    def _displace(self, model_rows: Any, future_rows: Any,
                  error: str) -> tuple[list[DisplacedModel], list[FutureState]]:
        now = self._clock()
        displaced_rows = model_rows & models.c.unloaded_at.is_(None)
        lost = future_rows & (futures.c.status == PENDING)
        with self.engine.begin() as connection:
            rows = connection.execute(select(models.c.model_id, models.c.base_model, models.c.lora_config,
                                             models.c.pruned_seq).where(displaced_rows)).all()
            last: dict[str, tuple[int, float]] = {}  # model -> (its highest seq, its latest request's time)
            for chunk in chunks([row.model_id for row in rows]):
                last.update((model_id, (seq, at)) for model_id, seq, at in connection.execute(
                    select(futures.c.model_id, func.max(futures.c.seq_id), func.max(futures.c.submitted_at))
                    .where(futures.c.model_id.in_(chunk), futures.c.seq_id >= 0).group_by(futures.c.model_id)))
            connection.execute(update(models).where(displaced_rows).values(trainer=None))
            failed = connection.execute(select(futures.c.request_id, futures.c.kind, futures.c.tenant)
                                        .where(lost)).all()
            connection.execute(update(futures).where(lost).values(
                status=FAILED, error=error, error_category="server", finished_at=now,
                finished_seq=self.finish_order.next()))
        # The most recently used first: when slots run short, those are the models most likely still wanted.
        rows = sorted(rows, key=lambda row: last.get(row.model_id, (0, 0.0))[1], reverse=True)
        displaced = [DisplacedModel(row.model_id, row.base_model, orjson.loads(row.lora_config),
                                    _next_seq(last.get(row.model_id, (None, 0.0))[0], row.pruned_seq))
                     for row in rows]
        return displaced, [FutureState(rid, FAILED, None, error, "server", kind, tenant)
                           for rid, kind, tenant in failed]

    def mark_unloaded(self, model_id: str, reason: str | None = None) -> None:
        """From now on ``route`` refuses the model (its row stays: it is a training run with checkpoints), saying
        ``reason`` when lilo unloads it itself."""
        with self.engine.begin() as connection:
            connection.execute(update(models).where(models.c.model_id == model_id, models.c.unloaded_at.is_(None))
                               .values(unloaded_at=self._clock(), unloaded_reason=reason))

    def model(self, model_id: str, tenant: str | None = None) -> dict[str, Any]:
        with self.engine.connect() as connection:
            row = connection.execute(select(models).where(models.c.model_id == model_id)).mappings().first()
        if row is None or not may_see(tenant, row["tenant"]):
            raise unknown_model_error(model_id)
        return _model_dict(row)

    def training_runs(self, limit: int | None, offset: int = 0,
                      tenant: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of models (``limit`` None: all; only ``tenant``'s when given), newest first, each with
        ``last_request_time``; and how many there are in all."""
        mine = _owned_by(models, tenant)
        with self.engine.connect() as connection:
            total = connection.execute(select(func.count()).select_from(models).where(mine)).scalar_one()
            rows = connection.execute(select(models).where(mine)
                                      .order_by(models.c.created_at.desc(), models.c.model_id)
                                      .limit(limit).offset(offset)).mappings().all()
            return self._with_last_request_time(connection, rows), total

    def training_run(self, model_id: str, tenant: str | None = None) -> dict[str, Any]:
        """One model, with ``last_request_time``."""
        with self.engine.connect() as connection:
            rows = connection.execute(select(models).where(models.c.model_id == model_id)).mappings().all()
            if not rows or not may_see(tenant, rows[0]["tenant"]):
                raise NotFoundError(f"Unknown training run {model_id!r}; pass a model_id create_model returned.")
            return self._with_last_request_time(connection, rows)[0]

    @staticmethod
    def _with_last_request_time(connection, rows: Sequence[Any]) -> list[dict[str, Any]]:
        """The rows as dicts with ``last_request_time``: the latest submission still kept, else the creation."""
        latest: dict[str, float] = {}
        for chunk in chunks([row["model_id"] for row in rows]):
            latest.update(connection.execute(select(futures.c.model_id, func.max(futures.c.submitted_at))
                                             .where(futures.c.model_id.in_(chunk)).group_by(futures.c.model_id)).all())
        return [{**_model_dict(row), "last_request_time": max(row["created_at"], latest.get(row["model_id"]) or 0)}
                for row in rows]

    def add_session(self, session_id: str, *, tenant: str | None = None, info: dict | None = None) -> None:
        now = self._clock()
        with self.engine.begin() as connection:
            connection.execute(sessions.insert().values(
                session_id=session_id, tenant=tenant, metadata=orjson.dumps(info or {}).decode(), created_at=now,
                last_heartbeat_at=now))

    def record_heartbeats(self, beats: dict[str, float]) -> None:
        """Write sessions' latest heartbeat times, gathered in memory, in one statement."""
        if beats:
            with self.engine.begin() as connection:
                connection.execute(update(sessions).where(sessions.c.session_id == bindparam("sid")).values(
                    last_heartbeat_at=bindparam("at")), [{"sid": sid, "at": at} for sid, at in beats.items()])

    def session_models(self, session_id: str, tenant: str | None) -> list[str]:
        """The models ``session_id`` created that are not unloaded (none when it is another tenant's)."""
        with self.engine.connect() as connection:
            return list(connection.execute(select(models.c.model_id).where(
                models.c.session_id == session_id, models.c.unloaded_at.is_(None), _owned_by(models, tenant))
                .order_by(models.c.model_id)).scalars())

    def idle_session_models(self, idle_s: float) -> list[tuple[str, str | None, str]]:
        """``(model_id, tenant, session_id)`` of every model not unloaded whose session's last heartbeat (or its
        creation, if it never beat) is more than ``idle_s`` ago."""
        with self.engine.connect() as connection:
            return [tuple(row) for row in connection.execute(
                select(models.c.model_id, models.c.tenant, models.c.session_id)
                .join(sessions, sessions.c.session_id == models.c.session_id)
                .where(models.c.unloaded_at.is_(None), sessions.c.last_heartbeat_at < self._clock() - idle_s)
                .order_by(models.c.model_id))]

    def check_session(self, session_id: str, tenant: str | None) -> None:
        """NotFoundError unless ``session_id`` is a session of ``tenant``."""
        with self.engine.connect() as connection:
            row = connection.execute(select(sessions.c.tenant).where(sessions.c.session_id == session_id)).first()
        if row is None or not may_see(tenant, row.tenant):
            raise unknown_session_error(session_id)

    def add_sampling_session(self, sampling_session_id: str, session_id: str, base_model: str,
                             model_path: str | None = None, tenant: str | None = None) -> None:
        """Record a sampling session; a retry is a no-op, a different session under the same id a conflict."""
        with self.engine.begin() as connection:
            connection.execute(database.insert(connection, sampling_sessions).values(
                sampling_session_id=sampling_session_id, session_id=session_id, base_model=base_model,
                model_path=model_path, created_at=self._clock(), tenant=tenant).on_conflict_do_nothing())
            row = connection.execute(select(sampling_sessions).where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)).mappings().one()
        if (row["session_id"], row["base_model"], row["model_path"]) != (session_id, base_model, model_path):
            raise ConflictError(
                f"Sampling session {sampling_session_id!r} already exists for "
                f"{row['model_path'] or row['base_model']!r};"
                " create each sampling client with the session's next sampling_session_seq_id.")

    def sampling_session(self, sampling_session_id: str, tenant: str | None = None) -> dict[str, Any]:
        with self.engine.connect() as connection:
            row = connection.execute(select(sampling_sessions).where(
                sampling_sessions.c.sampling_session_id == sampling_session_id)).mappings().first()
        if row is None or not may_see(tenant, row["tenant"]):
            raise unknown_sampling_session_error(sampling_session_id)
        return dict(row)

    def sample_to_cancel(self, request_id: int, tenant: str | None = None) -> str | None:
        """The trainer of a sample still pending, to cancel it there; None when it has finished. NotFoundError
        for a request that is not the caller's (or not at all), InvalidRequestError for one that is no sample."""
        with self.engine.connect() as connection:
            row = connection.execute(select(futures.c.kind, futures.c.status, futures.c.tenant, futures.c.trainer)
                                     .where(futures.c.request_id == request_id)).first()
        if row is None or not may_see(tenant, row.tenant):
            raise self.missing_error(request_id)
        if row.kind != Kind.SAMPLE:
            raise InvalidRequestError(f"Request {request_id} is a {row.kind}, not a sample; only samples can be "
                                      "cancelled (training requests run in their model's order).")
        return row.trainer if row.status == PENDING else None

    def join_sampling_session(self, sampling_session_id: str, tenant: str | None = None) -> int:
        """A new client of the session (an unpickled SamplingClient): its clone id, the session's next client count
        (the original client is 0)."""
        self.sampling_session(sampling_session_id, tenant)  # 404 unless it is the caller's
        with self.engine.begin() as connection:
            return connection.execute(
                update(sampling_sessions).where(sampling_sessions.c.sampling_session_id == sampling_session_id)
                .values(clients=func.coalesce(sampling_sessions.c.clients, 0) + 1)
                .returning(sampling_sessions.c.clients)).scalar_one()

    def billing_usage(self, tenant: str, start: float, end: float) -> dict[str, Any]:
        """The tenant's usage in hourly buckets (``lilo.futures.billing``)."""
        return billing.usage_events(self.engine, tenant, LOCAL_TENANT, start, end)

    def session_completions(self, polls: Sequence[tuple[SessionTarget, int]]
                            ) -> dict[tuple[SessionTarget, int], tuple[list[FinishedRequest], int]]:
        """What finished in each polled sampling session after its cursor (``session_completions``)."""
        return completions_after(self._read, polls, mark=self._reader.mark)

    def recorded_sequences(self, model_id: str, sequence_ids: Sequence[str],
                           tenant: str | None = None) -> dict[str, RecordedSequence]:
        """The recorded sequences a training request of ``model_id`` names (see ``sequences.take_for_training``); an
        unknown model, or another tenant's, is the usual 404."""
        session_id = self.model(model_id, tenant)["session_id"]
        with self.engine.begin() as connection:
            return sequences.take_for_training(connection, model_id, session_id, sequence_ids, tenant, self._clock())

    def close(self) -> None:
        self._reader.close()
        self.engine.dispose()


# The statements each submission and each batch of results runs, built once (building one costs more than running
# it on SQLite).
_RECORDS_OF = union_all(
    select(models.c.model_id, literal("model"), models.c.tenant, models.c.trainer, models.c.unloaded_at,
           models.c.unloaded_reason).where(models.c.model_id.in_(bindparam("ids", expanding=True))),
    select(sampling_sessions.c.sampling_session_id, literal("sampling"), sampling_sessions.c.tenant,
           *(cast(null(), column.type)
             for column in (models.c.trainer, models.c.unloaded_at, models.c.unloaded_reason)))
    .where(sampling_sessions.c.sampling_session_id.in_(bindparam("ids", expanding=True))))
_EXISTING_KEYS = select(futures.c.model_id, futures.c.seq_id, futures.c.request_id, futures.c.payload_sha256,
                        futures.c.status, futures.c.trainer).where(
    tuple_(futures.c.model_id, futures.c.seq_id).in_(bindparam("keys", expanding=True)))
_COMPLETE_FUTURE = update(futures).where(futures.c.request_id == bindparam("rid"), futures.c.status == PENDING).values(
    status=bindparam("status"), result=bindparam("result"), error=bindparam("error"),
    error_category=bindparam("category"), sampled_tokens=bindparam("sampled"), finished_at=bindparam("now"),
    finished_seq=bindparam("finished_seq"))
_INSERT_FUTURE = (
    "INSERT INTO futures (request_id, model_id, kind, seq_id, status, payload_sha256, tenant, "
    "submitted_at, trainer, billed_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_STATES = ("SELECT request_id, status, result, error, error_category, kind, tenant FROM futures "
           "WHERE request_id IN ({marks})")
_TENANTS = "SELECT request_id, tenant FROM futures WHERE request_id IN ({marks})"
_PENDING_TENANTS = _TENANTS + f" AND status = '{PENDING}'"


def merge_heartbeats(into: dict[str, float], beats: dict[str, float]) -> None:
    """Add sessions' heartbeat times to those noted in ``into``, keeping each session's latest."""
    for session_id, at in beats.items():
        into[session_id] = max(at, into.get(session_id, at))


# What an unknown record answers, and (so its existence is not revealed) another tenant's.
def unknown_model_error(model_id: str) -> NotFoundError:
    return NotFoundError(f"Unknown model_id {model_id!r}; pass the model_id that create_model returned.")


def unknown_sampling_session_error(sampling_session_id: str) -> NotFoundError:
    return NotFoundError(f"Unknown sampling session {sampling_session_id!r}; create it first.")


def no_usage() -> dict[str, int]:
    """A tenant's usage before it used anything: every count of ``FuturesStore.usage`` at 0."""
    return dict.fromkeys((*USAGE_COLUMNS, "models"), 0)


def _owned_by(table: Any, tenant: str | None) -> Any:
    """A WHERE clause: the table's rows ``tenant`` may see."""
    return true() if tenant is None else func.coalesce(table.c.tenant, LOCAL_TENANT) == tenant


def unloaded_error(model_id: str, reason: str | None = None) -> GoneError:
    if reason is not None:
        return GoneError(f"Model {model_id!r} was unloaded by the service: {reason}")
    return GoneError(f"Model {model_id!r} was unloaded (unload_model); create a new model, or one from a checkpoint "
                     "of it (create_training_client_from_state), to train again.")


class _Record(NamedTuple):
    """What a submission's group reads of the model or sampling session it names (placement: models only)."""

    kind: str  # "model" | "sampling"
    tenant: str | None
    trainer: str | None
    unloaded_at: float | None
    unloaded_reason: str | None


def _placed_trainer(model_id: str, row: Any) -> str:
    """The trainer of a model's row (``trainer``, ``unloaded_at``), or the error a request for it gets."""
    if row is None:
        raise unknown_model_error(model_id)
    if row.unloaded_at is not None:
        raise unloaded_error(model_id, row.unloaded_reason)
    if row.trainer is None:
        raise UnavailableError(f"Model {model_id!r} is being restored on another trainer after its trainer failed; "
                               "retry in a few seconds.")
    return row.trainer


def _model_dict(row: Any) -> dict[str, Any]:
    user_metadata = row["user_metadata"]
    return {**row, "lora_config": orjson.loads(row["lora_config"]),
            "user_metadata": None if user_metadata is None else orjson.loads(user_metadata)}


def _next_seq(highest: int | None, pruned: int | None) -> int | None:
    """The seq after a model's highest, among its futures and those pruned; None for a model with neither."""
    known = [seq for seq in (highest, pruned) if seq is not None]
    return max(known) + 1 if known else None


def _same_or_conflict(sub: Submission, request_id: int, known_print: str, new_print: str,
                      pending_on: str | None = None) -> SubmitOutcome:
    if known_print == new_print:
        return SubmitOutcome(request_id, duplicate=True, trainer=pending_on)
    return SubmitOutcome(None, error=ConflictError(
        f"seq_id {sub.seq_id} of model {sub.model_id!r} was already submitted (request {request_id}) with a "
        "different payload; send each new step with the next seq_id."))


def _short(error: Exception) -> str:
    return str(getattr(error, "orig", error)).splitlines()[0]


def _transient(error: Exception) -> bool:
    """Whether a failed write may succeed when tried again: SQLite's "database is locked", PostgreSQL's lock timeout
    or lost or refused connection (OperationalError), a connection the pool found dead, a pool timeout."""
    return not isinstance(error, DBAPIError) or isinstance(error, OperationalError) or error.connection_invalidated

