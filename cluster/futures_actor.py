"""The futures DB actor: the one process that writes the ledger behind every future, a SQLite file or a PostgreSQL
database (``--ledger``; lilo.futures.database).

An async Ray actor (``lilo-futures`` in namespace ``lilo``), pinned to the node that started the service (where a
SQLite file lives). All database work runs on one thread of its own, so the event loop keeps answering while the
database works: submissions that arrive together share a commit (in arrival order), completions are written in
batches, and every parked ``retrieve`` is answered by one query per tick. It restarts after a crash and reopens the
same ledger, so nothing it acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import ray
from ray.util import metrics
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sqlalchemy.exc import OperationalError

from cluster.local import NAMESPACE
from cluster.worker_setup import freeze_startup
from lilo.errors import QuotaExceededError
from lilo.futures.admission import Admission
from lilo.futures.database import LedgerUnreachableError
from lilo.futures.group_commit import GroupCommitter
from lilo.futures.request_traces import RequestTraces
from lilo.engine.commands import Kind
from lilo.futures.schema import PENDING
from lilo.futures.session_completions import FinishedRequest, SessionTarget
from lilo.futures.session_waiter import SessionWaiter
from lilo.backend.provenance import RecordedSequence
from lilo.futures.store import (
    DEFAULT_RETENTION_S, Completion, DisplacedModel, FuturesStore, FutureState, Submission, SubmitOutcome,
    merge_heartbeats, no_usage, parse_request_id,
)
from lilo.futures.pushes import FinishedPushes
from lilo.futures.waiter import FutureWaiter
from lilo.tenant_policy import PolicyFile, TenantLimits
from lilo.tenants import tenant_of

logger = logging.getLogger(__name__)

FUTURES_ACTOR_NAME = "lilo-futures"
# Under the SDK's 45 s read timeout for retrieve_future, so a long-poll answers before the client gives up.
RETRIEVE_TIMEOUT_S = 40.0
# A sampling session's long poll (retrieve_futures): the SDK expects about 30 s and gives up after 45.
SESSION_POLL_TIMEOUT_S = 30.0
# Outbox retries, heartbeat writes and (every PRUNE_EVERY_S) pruning run this often.
MAINTAIN_EVERY_S = 5.0
PRUNE_EVERY_S = 600.0
# Each tenant's counts exported as Ray metrics, lilo_tenant_<name>.
USAGE_METRICS = {"train_tokens": "Tokens of forward and forward_backward requests recorded",
                 "sample_tokens": "Tokens of sample requests recorded (prompt and completions)",
                 "requests": "Requests recorded", "models": "Models held", "inflight": "Requests not yet finished"}
# A PostgreSQL ledger that does not answer when the actor (re)starts is tried again this long before the actor gives
# up (its start already checked it answers: this covers a restart while the database is briefly away).
OPEN_RETRY_S = 60.0
ORPHAN_MESSAGE = ("The service stopped before this request finished, so it did not take effect; send it again to the "
                  "running service.")


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=10_000)
class FuturesActor:
    def __init__(self, ledger: str, retention_s: float = DEFAULT_RETENTION_S) -> None:
        """``ledger``: the SQLite file's path, or a ``postgresql://`` URL."""
        self._store = _open_store(ledger, retention_s)
        self._policy = PolicyFile(None)  # the tenants file's (use_tenants_file)
        self._admission = Admission()
        self._usage_gauges: dict[str, Any] | None = None
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lilo-futures-db")
        self._waiter = FutureWaiter(lambda ids: self._run(self._store.states, ids),
                                    missing=lambda request_id: self._run(self._store.missing_error, request_id))
        self._sessions = SessionWaiter(lambda polls: self._run(self._store.session_completions, polls))
        self._pushes = FinishedPushes()
        self._pushed_unwritten: set[int] = set()  # results pushed (and counted finished) before their write landed
        self._incarnation = uuid.uuid4().hex  # a restarted actor has none of the pushes' subscriptions
        self._committer = GroupCommitter(lambda group: self._run(self._store.submit_many, group))
        self._maintenance: asyncio.Task | None = None
        self._heartbeats: dict[str, float] = {}  # session -> its latest heartbeat, not yet written
        self._retrieves = 0  # retrieve calls (each a client's retrieve_future), for stats and benchmarks
        self._burst_calls = 0  # submit_once_many calls, and the submissions they carried (stats)
        self._burst_submissions = 0
        self._traces = RequestTraces.if_enabled()
        freeze_startup()

    async def _run(self, function: Callable, *args: Any) -> Any:
        self._start_maintenance()
        return await asyncio.get_running_loop().run_in_executor(self._db, function, *args)

    def _start_maintenance(self) -> None:
        if self._maintenance is None or self._maintenance.done():
            self._maintenance = asyncio.get_running_loop().create_task(self._maintain())

    async def _maintain(self) -> None:
        since_prune = 0.0
        while True:
            await asyncio.sleep(MAINTAIN_EVERY_S)
            since_prune += MAINTAIN_EVERY_S
            try:
                loop = asyncio.get_running_loop()
                if self._store.outbox_size:
                    await loop.run_in_executor(self._db, self._store.flush_outbox)
                await loop.run_in_executor(self._db, self._store.record_heartbeats, self._take_heartbeats())
                self._admission.recount(await loop.run_in_executor(self._db, self._store.pending_by_tenant))
                await loop.run_in_executor(self._db, self._store.add_usage, self._admission.take_usage())
                self._export_usage(await self.usage())
                if since_prune >= PRUNE_EVERY_S:
                    since_prune = 0.0
                    pruned = await loop.run_in_executor(self._db, self._store.prune)
                    if pruned:
                        logger.info("pruned %d futures past the retention time", pruned)
            except Exception:
                logger.exception("futures maintenance failed; trying again later")

    def _take_heartbeats(self) -> dict[str, float]:
        """The heartbeats noted since the last write, to write now."""
        beats, self._heartbeats = self._heartbeats, {}
        return beats

    # --- futures -------------------------------------------------------------------------------------------
    async def submit(self, submission: Submission) -> int:
        """Record one request; returns its id (an identical retry returns the first id; a clash raises 409)."""
        return (await self.submit_once(submission)).request_id  # type: ignore[return-value]

    async def submit_once(self, submission: Submission, subscriber: str | None = None) -> SubmitOutcome:
        """Like ``submit``, also saying whether it was a retry of a request already recorded (not to run again), and
        its tenant's weight. A tenant over a rate limit is refused first (429, lilo.futures.admission). With a
        ``subscriber`` (an ingress replica), its result is pushed there once written (``finished_for``)."""
        started_ns = time.time_ns()
        tenant = tenant_of(submission.tenant)
        limits = self._policy.current().of(tenant)
        outcome: SubmitOutcome | None = None
        try:
            self._admission.check(tenant, limits, submission.kind, submission.tokens)
            outcome = await self._committer.submit(submission)
        finally:
            if self._traces is not None:
                self._traces.recorded(submission, outcome, started_ns)
        if outcome.error is not None:
            raise outcome.error
        if not outcome.duplicate or outcome.pending:
            self._waiter.expect(outcome.request_id)  # its result is written here: its retrieves need no polling
            if subscriber is not None:
                self._pushes.subscribe(outcome.request_id, subscriber, submission.tenant)
        if not outcome.duplicate:
            self._admission.admitted(tenant, submission.kind, submission.tokens)
        return dataclasses.replace(outcome, weight=limits.weight)

    async def submit_once_many(self, submissions: list[Submission], subscriber: str | None = None,
                               ) -> list[SubmitOutcome | BaseException]:
        """``submit_once`` each of ``submissions`` (an ingress replica's burst, in one call; recorded in the same
        group commits): for each, its outcome or the error it raised."""
        self._burst_calls += 1
        self._burst_submissions += len(submissions)
        if len(submissions) == 1:  # a lone request: no task of its own
            try:
                return [await self.submit_once(submissions[0], subscriber)]
            except Exception as error:
                return [error]
        return await asyncio.gather(*(self.submit_once(submission, subscriber) for submission in submissions),
                                    return_exceptions=True)

    # --- tenants -------------------------------------------------------------------------------------------
    async def use_tenants_file(self, path: str | None) -> None:
        """Take each tenant's share and limits from ``path`` (None: all weight 1, unlimited), re-read as it
        changes; raises TenantsFileError, saying what to fix, when it does not parse."""
        self._policy = PolicyFile(path)

    async def reload_tenants(self) -> str | None:
        """Re-read the tenants file now (``lilo up`` on SIGHUP); the error that kept its new version out, or None."""
        return None if self._policy.reload() else self._policy.error

    async def usage(self, tenant: str | None = None) -> dict[str, dict[str, Any]]:
        """Each tenant's usage (only ``tenant``'s when given; else every tenant with records or named in the tenants
        file): tokens trained and sampled and requests since the file was made, models held, requests in flight, and
        its limits."""
        found = await self._run(self._store.usage, tenant)
        for owner, counts in self._admission.unwritten().items():
            if tenant is None or owner == tenant:
                row = found.setdefault(owner, no_usage())
                for column, count in counts.items():
                    row[column] += count
        policy = self._policy.current()
        for named in [tenant] if tenant is not None else policy.tenants:  # the file's tenants, used or not
            found.setdefault(named, no_usage())
        return {owner: {**row, "inflight": self._admission.inflight[owner],
                        "limits": dataclasses.asdict(policy.of(owner))} for owner, row in found.items()}

    def _export_usage(self, usage: dict[str, dict[str, Any]]) -> None:
        """Each tenant's counts as Ray metrics (``lilo_tenant_<count>{tenant}``), for Prometheus and the dashboard."""
        if self._usage_gauges is None:
            self._usage_gauges = {name: metrics.Gauge(f"lilo_tenant_{name}", description, ("tenant",))
                                  for name, description in USAGE_METRICS.items()}
        for tenant, row in usage.items():
            for name, gauge in self._usage_gauges.items():
                gauge.set(row[name], tags={"tenant": tenant})

    async def limits_of(self, tenant: str) -> TenantLimits:
        return self._policy.current().of(tenant)

    async def is_admin(self, tenant: str) -> bool:
        """Whether the tenants file marks ``tenant`` admin (its console shows every tenant)."""
        return self._policy.current().is_admin(tenant)

    async def check_new_model(self, tenant: str, base_model: str, rank: int) -> None:
        """Raises QuotaExceededError when ``tenant`` may not create a model of ``base_model`` at ``rank``: a base
        model its table does not allow, a rank over its max_rank, or max_models models held already."""
        limits = self._policy.current().of(tenant)
        if limits.base_models is not None and base_model not in limits.base_models:
            allowed = ", ".join(limits.base_models) or "none"
            raise QuotaExceededError(f"Tenant {tenant!r} may not train {base_model!r} (base_models in the tenants "
                                     f"file allows {allowed}); create the model on one of those.")
        if limits.max_rank is not None and rank > limits.max_rank:
            raise QuotaExceededError(f"Tenant {tenant!r} may create LoRA models up to rank {limits.max_rank} "
                                     f"(max_rank in the tenants file), not {rank}; ask for a lower rank.")
        if limits.max_models is not None:
            held = await self._run(self._store.loaded_models, tenant)
            if held >= limits.max_models:
                raise QuotaExceededError(
                    f"Tenant {tenant!r} may hold {limits.max_models} models (max_models in the tenants file) and "
                    f"holds {held}; unload one it no longer trains (unload_model) before creating another.")

    async def complete(self, completions: Sequence[Completion]) -> bool:
        """Write a batch of results; parked retrieves of them wake at once. False: kept in the outbox.

        Each result is pushed to the replica that submitted its request as it comes in, while it is written (the
        write is a millisecond of each operation's path on a small machine): from here it is written in the end,
        retried and kept in the outbox meanwhile, and its trainer sends it again while this actor does not answer.
        It counts as finished against its tenant's ``max_inflight`` from then on, since its client may send the
        next request at once. A sample with recorded sequences is pushed once written: its client may train on
        them next, which the ingress reads from the ledger."""
        started_ns = time.time_ns()
        for completion in completions:
            pushed = self._pushes.push_completion(completion) if completion.recorded is None else None
            if pushed is not None:
                self._pushed_unwritten.add(pushed.request_id)
                self._admission.finished({pushed.request_id: tenant_of(pushed.tenant)})
        tenants = await self._run(self._complete_many, list(completions))
        if self._traces is not None:
            self._traces.completed(completions, started_ns, written=tenants is not None)
        if tenants is None:
            return False
        self._admission.finished({request_id: tenant_of(tenant) for request_id, tenant in tenants.items()
                                  if request_id not in self._pushed_unwritten})
        self._pushed_unwritten.difference_update(completion.request_id for completion in completions)
        if any(completion.kind == Kind.SAMPLE for completion in completions):
            self._sessions.wake()
        for completion in completions:
            if completion.request_id not in tenants:
                continue  # it had failed already (its trainer evacuated): the write kept that, and so do its waiters
            self._finished(FutureState.of(completion, tenants.get(completion.request_id)))
        return True

    def _finished(self, state: FutureState) -> None:
        """A result this actor wrote: its parked retrieves wake, and it is pushed to the replica that submitted it."""
        self._waiter.notify(state)
        self._pushes.push(state)

    async def finished_for(self, subscriber: str, timeout_s: float) -> tuple[str, list[FutureState]]:
        """The results pushed to ``subscriber`` (an ingress replica) since it last asked, once there are some or
        after ``timeout_s``; with this actor's incarnation, which changes when it restarts (and forgets who
        subscribed)."""
        return self._incarnation, await self._pushes.take(subscriber, timeout_s)

    def _complete_many(self, completions: list[Completion]) -> dict[int, str | None] | None:
        """On the database thread: read whose the requests still pending are (one query per batch, so a waiter gets
        a result at once only when it is its own), then write the results, which change only those; None when they
        went to the outbox."""
        try:
            pending = self._store.tenants_of([completion.request_id for completion in completions], pending=True)
        except OperationalError as error:
            # The database is unreachable for now (PostgreSQL down): the write below retries, then keeps the
            # results in the outbox. Parked retrieves then learn them from their next poll, not at once.
            logger.warning("could not read whose %d completed request(s) are (%s); writing them anyway",
                           len(completions), str(error.orig or error).splitlines()[0])
            pending = {}
        if not self._store.complete_many(completions):
            return None
        return pending

    async def retrieve(self, request_id: int | str, timeout_s: float = RETRIEVE_TIMEOUT_S,
                       tenant: str | None = None) -> FutureState:
        """The request's state once finished, or its pending state after ``timeout_s`` (the long-poll). Another
        tenant's request answers as one that does not exist.

        Every caller joins the shared waiter, even for a result that is already there: a burst of retrieves
        costs one query per tick between them, never one each.
        """
        request_id = parse_request_id(request_id)
        self._retrieves += 1
        if timeout_s <= 0:
            return await self._run(self._store.lookup, request_id, tenant)
        try:
            return await self._waiter.wait(request_id, timeout_s, tenant)
        except TimeoutError:
            return FutureState(request_id, PENDING)

    async def retrieve_session(self, sampling_session_id: str, clone: int, cursor: int,
                               timeout_s: float = SESSION_POLL_TIMEOUT_S) -> tuple[list[FinishedRequest], int]:
        """What finished in a sampling client's requests after ``cursor`` (the SDK's retrieve_futures), and the
        cursor to poll with next: at once when something has, else once something does or after ``timeout_s``
        (0: at once either way). Whose session it is, the caller checked."""
        return await self._sessions.wait(SessionTarget(sampling_session_id, clone), cursor,
                                         min(timeout_s, SESSION_POLL_TIMEOUT_S))

    async def sample_to_cancel(self, request_id: int | str, tenant: str | None = None) -> str | None:
        return await self._run(self._store.sample_to_cancel, parse_request_id(request_id), tenant)

    async def join_sampling_session(self, sampling_session_id: str, tenant: str | None = None) -> int:
        return await self._run(self._store.join_sampling_session, sampling_session_id, tenant)

    async def add_model(self, model_id: str, base_model: str, lora_config: dict, **record: Any) -> None:
        await self._run(lambda: self._store.add_model(model_id, base_model, lora_config, **record))

    async def place_model(self, model_id: str, trainer: str) -> None:
        await self._run(self._store.place_model, model_id, trainer)

    async def placement(self, tenant: str | None = None) -> dict[str, str | None]:
        return await self._run(self._store.placement, tenant)

    # ``tenant``: the caller's; another tenant's record answers as one that does not exist. None: lilo itself.
    async def trainer_of(self, model_id: str, tenant: str | None = None) -> str | None:
        return await self._run(self._store.trainer_of, model_id, tenant)

    async def tenant_and_trainer_of(self, record_id: str) -> tuple[str | None, str | None]:
        return await self._run(self._store.tenant_and_trainer_of, record_id)

    async def model(self, model_id: str, tenant: str | None = None) -> dict[str, Any]:
        return await self._run(self._store.model, model_id, tenant)

    async def evacuate(self, trainer: str, error: str) -> list[DisplacedModel]:
        """A trainer failed: its unfinished requests fail with ``error`` (parked retrieves wake at once) and its
        models are unplaced until restored; returns those models."""
        return self._woken(*await self._run(self._store.evacuate, trainer, error))

    async def evacuate_strays(self, trainers: Sequence[str], error: str) -> list[DisplacedModel]:
        """At the recovery actor's start: ``evacuate`` for the models on none of ``trainers``."""
        return self._woken(*await self._run(self._store.evacuate_strays, list(trainers), error))

    def _woken(self, displaced: list[DisplacedModel], failed: Sequence[FutureState]) -> list[DisplacedModel]:
        """The displaced models, once the parked retrieves of the futures failed with them are woken."""
        for state in failed:
            self._finished(state)
        if any(state.kind == Kind.SAMPLE for state in failed):
            self._sessions.wake()
        return displaced

    async def fail_orphans(self) -> int:
        """At service start: fail what a previous run left pending (its trainers are gone); returns how many."""
        return await self._run(self._store.fail_all_pending, ORPHAN_MESSAGE)

    async def mark_unloaded(self, model_id: str, reason: str | None = None) -> None:
        await self._run(self._store.mark_unloaded, model_id, reason)

    async def training_runs(self, limit: int | None, offset: int = 0,
                            tenant: str | None = None) -> tuple[list[dict[str, Any]], int]:
        return await self._run(self._store.training_runs, limit, offset, tenant)

    async def training_run(self, model_id: str, tenant: str | None = None) -> dict[str, Any]:
        return await self._run(self._store.training_run, model_id, tenant)

    async def add_session(self, session_id: str, **record: Any) -> None:
        await self._run(lambda: self._store.add_session(session_id, **record))

    async def note_heartbeats(self, beats: dict[str, float]) -> None:
        """Sessions' latest heartbeat times, as an API replica noted them (``serve.tinker.heartbeats``); written with
        the next maintenance round."""
        merge_heartbeats(self._heartbeats, beats)

    async def session_models(self, session_id: str, tenant: str | None) -> list[str]:
        return await self._run(self._store.session_models, session_id, tenant)

    async def idle_session_models(self, idle_s: float) -> list[tuple[str, str | None, str]]:
        """Models of sessions idle for ``idle_s`` (heartbeats noted in memory are written first)."""
        await self._run(self._store.record_heartbeats, self._take_heartbeats())
        return await self._run(self._store.idle_session_models, idle_s)

    async def check_session(self, session_id: str, tenant: str | None) -> None:
        await self._run(self._store.check_session, session_id, tenant)

    async def add_sampling_session(self, sampling_session_id: str, session_id: str, base_model: str,
                                   model_path: str | None = None, tenant: str | None = None) -> None:
        await self._run(self._store.add_sampling_session, sampling_session_id, session_id, base_model, model_path,
                        tenant)

    async def sampling_session(self, sampling_session_id: str, tenant: str | None = None) -> dict[str, Any]:
        return await self._run(self._store.sampling_session, sampling_session_id, tenant)

    # --- sessions as the RestClient reads them (lilo.futures.session_queries) --------------------------------
    async def record_session_finish(self, session_id: str, tenant: str | None, finished: dict) -> None:
        await self._run(self._store.sessions.record_finish, session_id, tenant, finished)

    async def session_page(self, tenant: str, limit: int, offset: int) -> list[str]:
        return await self._run(self._store.sessions.page, tenant, limit, offset)

    async def session_detail(self, session_id: str, tenant: str) -> tuple[Any, list[str], list[str]]:
        return await self._run(self._store.sessions.detail, session_id, tenant)

    async def search_sessions(self, tenant: str, query: dict, limit: int,
                              after: tuple[float, str] | None) -> tuple[list[Any], bool]:
        return await self._run(self._store.sessions.search, tenant, query, limit, after)

    async def billing_usage(self, tenant: str, start: float, end: float) -> dict[str, Any]:
        return await self._run(self._store.billing_usage, tenant, start, end)

    async def session_requests(self, session_id: str, tenant: str, limit: int) -> list[dict[str, Any]]:
        return await self._run(self._store.sessions.requests, session_id, tenant, limit)

    async def session_runs(self, session_ids: Sequence[str]) -> dict[str, list[dict]]:
        return await self._run(self._store.sessions.runs_of, list(session_ids))

    # --- custom losses (lilo.futures.custom_losses) ---------------------------------------------------------
    async def add_custom_loss(self, loss_id: str, session_id: str, tenant: str | None, body: dict) -> None:
        await self._run(self._store.custom_losses.add, loss_id, session_id, tenant, body)

    async def custom_loss(self, loss_id: str, tenant: str | None) -> dict:
        return await self._run(self._store.custom_losses.get, loss_id, tenant)

    # --- checkpoints: expiry and publication (lilo.futures.checkpoint_records) -----------------------------
    async def readable_checkpoint(self, path: str, tenant: str | None, write: bool = False) -> tuple[dict, Any]:
        """(run, record) when ``tenant`` may use the checkpoint ``path``; else its run's 404, or 410 once expired."""
        return await self._run(self._store.checkpoints.readable, path, tenant, write)

    async def record_checkpoint_save(self, path: str, tenant: str | None, expires_at: float | None) -> None:
        await self._run(self._store.checkpoints.record_save, path, tenant, expires_at)

    async def set_checkpoint_expiry(self, path: str, tenant: str | None, expires_at: float | None) -> None:
        await self._run(self._store.checkpoints.set_expiry, path, tenant, expires_at)

    async def set_checkpoint_public(self, path: str, tenant: str | None, public: bool) -> None:
        await self._run(self._store.checkpoints.set_public, path, tenant, public)

    async def forget_checkpoint(self, path: str) -> None:
        await self._run(self._store.checkpoints.forget, path)

    async def checkpoint_records(self, model_ids: Sequence[str]) -> dict[str, Any]:
        return await self._run(self._store.checkpoints.of_runs, list(model_ids))

    async def expired_checkpoints(self) -> list[tuple[Any, str | None]]:
        return await self._run(self._store.checkpoints.due)

    async def mark_checkpoints_deleted(self, paths: Sequence[str]) -> None:
        await self._run(self._store.checkpoints.mark_deleted, list(paths))

    # --- health --------------------------------------------------------------------------------------------
    async def recorded_sequences(self, model_id: str, sequence_ids: Sequence[str],
                                 tenant: str | None = None) -> dict[str, RecordedSequence]:
        """The recorded sequences a stable_reinforce request of ``model_id`` names, their day restarted; raises a
        client error naming the first that is unknown, expired or from another session."""
        return await self._run(self._store.recorded_sequences, model_id, list(sequence_ids), tenant)

    async def stats(self) -> dict[str, Any]:
        counts = await self._run(self._store.count_by_status)
        db_mb, wal_mb = await self._run(self._store.file_sizes_mb)
        return {"futures": counts, "outbox": self._store.outbox_size, "parked_waiters": self._waiter.parked,
                "waiter_queries": self._waiter.queries, "retrieves": self._retrieves,
                "burst_calls": self._burst_calls, "burst_submissions": self._burst_submissions,
                "parked_session_polls": self._sessions.parked, "session_polls": self._sessions.polls,
                "session_poll_queries": self._sessions.queries,
                "group_commits": self._committer.commits, "statements": self._store.statements,
                "commits": self._store.commits, "db_mb": db_mb, "wal_mb": wal_mb, "db_path": self._store.location,
                "pid": os.getpid()}


def _open_store(ledger: str, retention_s: float) -> FuturesStore:
    deadline = time.monotonic() + OPEN_RETRY_S
    while True:
        try:
            return FuturesStore(ledger, retention_s=retention_s)
        except LedgerUnreachableError as error:
            if time.monotonic() > deadline:
                raise
            logger.warning("%s Trying again.", error)
            time.sleep(2.0)


def get_futures_actor(ledger: str, name: str = FUTURES_ACTOR_NAME, **options: Any) -> ray.actor.ActorHandle:
    """The cluster's futures DB actor, created on first use on this driver's node (where a SQLite file lives), on
    ``ledger``: the file's path, or a ``postgresql://`` URL (``cluster.service.ledger_of``)."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return FuturesActor.options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, scheduling_strategy=here,
    ).remote(ledger, **options)
