"""The Engine: per-model ordered queues, the coalescing scheduler, and two lanes around a backend (``contract``
says how the engine's models map onto the backend's adapters, and what each backend call guarantees).

Plain Python threads, no Ray: the compute lane runs one backend execution at a time (a coalesced batch, a fused
optimizer step, a capture, an adapter being added), the persist lane writes checkpoints to disk meanwhile. Every
command is resolved on its own ``concurrent.futures.Future`` as soon as its batch finishes, with its own error when
only it failed. Sample commands skip the models' ordered queues: they wait in one queue of their own, which takes
its turn in the rotation like a model, each turn one generation over as many samples as fit the token budget.

Telemetry: the engine reports through the Observer protocol only (``begin`` at submission, one ``span`` per
physical batch with every model, ``request_ids``, ``n`` and ``ok``; ``capture:<kind>`` / ``persist:<kind>`` on
their lanes; ``accept`` for a new model; ``page_in:<kind>`` / ``page_out:<kind>`` on the model whose command
needed a model paged back into a slot, or a slot freed, before it ran; ``coalesce_wait:<kind>`` for a pass that
held its coalescing window open, with the request ids of every command it ran). Whatever observer it is given is
composed with its own CriticalPath, ``engine.timings``, so timing cannot be switched off, and its TenantUsage,
``engine.usage`` (each tenant's share of the passes' execute time).

The coalescing window (``lilo.engine.window``): a forward, forward_backward or optim_step pass that could start
while other models stepping in rhythm with it have no command queued yet waits a bounded time for theirs, then
runs everything that arrived as one pass. ``window_cap_ms=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from lilo.backend.types import LoraSpec
from lilo.engine.commands import SAVING_KINDS, Command, Kind
from lilo.engine.contract import Backend
from lilo.engine.fair_share import FairShare
from lilo.engine.queues import ModelQueue
from lilo.engine.scheduler import TOKENS_PER_BATCH, next_batch, turn_order
from lilo.engine.window import (
    DEFAULT_WINDOW_CAP_MS, FAIR_WINDOW_CAP_S, FAIR_WINDOW_SHARE_OF_PASS, WINDOW_KINDS, Rhythm, awaited, window_s,
)
from lilo.errors import CancelledByClientError, ConflictError, GoneError, InvalidRequestError, NotFoundError
from lilo.timing.critical_path import CriticalPath, Observer, Observers, Operation
from lilo.timing.tenant_usage import TenantUsage

logger = logging.getLogger(__name__)

COMPUTE_LANE = "compute"
PERSIST_LANE = "persist"
# The place of sample commands in the rotation: they take turns with the models like one more model.
SAMPLING_TURN = "\x00sampling"
REMEMBERED_UNLOADS = 100_000
# Sample request ids remembered, so a retry handed over again does not generate twice.
REMEMBERED_SAMPLES = 4096
# Models whose page files the persist lane reads ahead of their turn, after each batch is chosen.
PREFETCH_AHEAD = 2


class EngineStopped(RuntimeError):
    """The engine shut down before this command ran."""


@dataclasses.dataclass(frozen=True)
class _Window:
    """A coalescing window held open for the pass of the command ``request_id``: it stays that pass's window while
    the command is in the batch, wherever the rotation puts it once the awaited commands joined (it may come second)."""

    request_id: str
    opened_s: float
    deadline_s: float

    def opened_for(self, batch: Sequence[Command]) -> bool:
        return any(command.request_id == self.request_id for command in batch)


class Engine:
    def __init__(self, backend: Backend[Any], observer: Observer | None = None, *,
                 token_budget: int = TOKENS_PER_BATCH, first_seq: int = 1, coalesce: bool = True,
                 window_cap_ms: float = DEFAULT_WINDOW_CAP_MS, clock: Callable[[], float] = time.monotonic,
                 start: bool = True) -> None:
        self._backend = backend
        self._ranks = backend.pass_ranks()
        self._clock = clock
        self._token_budget = token_budget
        self._coalesce = coalesce
        self._window_cap_s = window_cap_ms / 1e3 if coalesce else 0.0
        self._window: _Window | None = None
        self._first_seq = first_seq
        self.timings = CriticalPath(clock=clock)
        self.usage = TenantUsage()
        self.observer = Observers(*([observer] if observer is not None else []), self.timings, self.usage)
        self._rhythm = Rhythm()  # the models' think times and the passes' durations, for the window
        self._queues: dict[str, ModelQueue] = {}
        # Samples are independent of each other and of training, so no model queue orders them: a client's
        # samples may arrive in any order, and one refused at the door leaves no gap to wait for. A retry gets
        # here only while its first is pending (the futures DB dedupes the rest); ``_sample_futures`` catches it.
        self._samples: deque[tuple[Command, Future]] = deque()
        self._sample_futures: OrderedDict[str, Future] = OrderedDict()  # request id -> future, the latest ones
        self._cancelled: set[str] = set()  # samples cancelled while running: they fail once their generation ends
        self._rotation: list[str] = [SAMPLING_TURN]
        self._fair = FairShare(clock)  # each tenant's and model's service, for its share of full passes
        self._tenants: dict[str, str] = {}  # model -> its tenant, as its latest command said
        self._lifecycle: deque[Callable[[], None]] = deque()
        self._unloading: dict[str, Future] = {}  # model -> its unload, waiting for the model's queue to run dry
        # Models unloaded lately: a client still sending to one is told so, not that it never existed.
        self._unloaded: OrderedDict[str, None] = OrderedDict()
        self._cv = threading.Condition()
        self._stopped = False
        self._prefetching = False
        self._persist_jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._compute_loop, name="lilo-engine-compute", daemon=True),
            threading.Thread(target=self._persist_loop, name="lilo-engine-persist", daemon=True),
        ]
        if start:
            self.start()

    def start(self, compute_thread: bool = True) -> None:
        """Start the lanes (``start=False`` lets a caller queue work first, then release it all at once).

        ``compute_thread=False`` leaves the compute lane to ``run_compute_lane`` on a thread of the caller's
        choosing: on CPU, torch runs its ops in parallel well only from the one thread that did its other work
        (measured here: a second thread running the same step took 1.8x as long), so a trainer runs the compute
        lane on the thread that loaded the model.
        """
        threads = self._threads if compute_thread else self._threads[1:]
        for thread in threads:
            if not thread.is_alive():
                thread.start()

    def run_compute_lane(self) -> None:
        """Run the compute lane on the calling thread until ``stop()``."""
        self._compute_loop()

    # --- models --------------------------------------------------------------------------------------------
    def create_model(self, model_id: str, spec: LoraSpec, first_seq: int | None = None) -> Future:
        """Create a model (the backend adds its adapter); commands for it may be submitted at once and run once
        the adapter is in place. ``first_seq`` overrides the engine's first seq id for this model (a model created
        by loading a checkpoint runs that load as its seq 0, before the client's first step)."""
        future: Future = Future()
        with self._cv:
            if model_id in self._queues:
                raise ConflictError(f"Model {model_id!r} already exists on this trainer.")
            self._queues[model_id] = ModelQueue(self._first_seq if first_seq is None else first_seq)
            self._rotation.append(model_id)
            self.observer.register_model(model_id, spec)
            self._lifecycle.append(lambda: self._accept(model_id, spec, future))
            self._cv.notify_all()
        return future

    def model_ids(self) -> set[str]:
        """The models this engine holds, from the moment ``create_model`` is called."""
        with self._cv:
            return set(self._queues)

    def unload_model(self, model_id: str) -> Future:
        """Unload a model once the commands it already holds in seq order have run (then the backend removes its
        adapter); commands submitted from now on are refused, and any held behind a seq that never arrived fail
        with a message when it goes."""
        future: Future = Future()
        with self._cv:
            self._model_queue(model_id)
            if model_id in self._unloading:
                raise GoneError(f"Model {model_id!r} is already being unloaded.")
            self._unloading[model_id] = future
            self._cv.notify_all()
        return future

    def _accept(self, model_id: str, spec: LoraSpec, future: Future) -> None:
        t0 = self._clock()
        try:
            self._make_resident([model_id], "accept", {model_id: []})
            t0 = self._clock()
            self._backend.add_adapter(model_id, spec)
        except Exception as error:
            self.observer.span(model_id, "accept", COMPUTE_LANE, t0, self._clock(), n=1, ok=False)
            with self._cv:
                held = self._forget(model_id)
            self._settle(future, error)
            for command, pending in held:
                self._settle(pending, RuntimeError(
                    f"Model {model_id!r} could not be created ({error}), so request {command.request_id} never ran."))
            return
        self.observer.span(model_id, "accept", COMPUTE_LANE, t0, self._clock(), n=1, ok=True)
        with self._cv:
            self._queues[model_id].ready = True
            self._cv.notify_all()
        future.set_result(model_id)

    def _unload(self, model_id: str, future: Future) -> None:
        with self._cv:
            if model_id not in self._queues:
                self._settle(future, NotFoundError(f"Model {model_id!r} was already removed."))
                return
            held = self._forget(model_id)
        for command, pending in held:
            self._settle(pending, NotFoundError(
                f"Model {model_id!r} was removed before request {command.request_id} ran."))
        try:
            self._backend.remove_adapter(model_id)
        except Exception as error:
            self._settle(future, error)
            return
        self.observer.forget_model(model_id)
        future.set_result(model_id)

    def _forget(self, model_id: str) -> list[tuple[Command, Future]]:
        model_queue = self._queues.pop(model_id)
        self._tenants.pop(model_id, None)
        self._rotation.remove(model_id)
        self._rhythm.forget(model_id)
        self._fair.forget(model_id)
        return model_queue.drain()

    def _model_queue(self, model_id: str) -> ModelQueue:
        model_queue = self._queues.get(model_id)
        if model_queue is None:
            raise NotFoundError(f"Unknown model_id {model_id!r} on this trainer; create the model first.")
        return model_queue

    # --- commands ------------------------------------------------------------------------------------------
    def submit(self, command: Command) -> Future:
        """Queue a command in its model's seq order; a retry of a known seq returns the first future."""
        with self._cv:
            if self._stopped:
                raise EngineStopped("The engine is stopped; no new work is accepted.")
            future: Future = Future()
            if command.model_id in self._unloading or command.model_id in self._unloaded:
                raise GoneError(f"Model {command.model_id!r} was unloaded; create a new model (or one from a "
                                "checkpoint) to train again.")
            if command.kind == Kind.SAMPLE:
                # Samples have no seq order to dedupe them: a retry handed over again (its request id known)
                # gets the first future, not a second generation.
                accepted = self._sample_futures.setdefault(command.request_id, future)
                if accepted is future:
                    self._samples.append((command, future))
                    while len(self._sample_futures) > REMEMBERED_SAMPLES:
                        self._sample_futures.popitem(last=False)
            else:
                model_queue = self._model_queue(command.model_id)
                self._tenants[command.model_id] = command.tenant
                idle_since = None if model_queue.has_work else model_queue.idle_since_s
                accepted = model_queue.offer(command, future)
                if accepted is future and idle_since is not None:
                    self._rhythm.learn(command.model_id, command.kind, self._clock() - idle_since, command.tokens)
            if accepted is future:
                self.observer.begin(Operation(command.model_id, command.request_id, command.kind, self._clock(),
                                              command.tenant, command.tokens, command.trace))
                self._cv.notify_all()
            return accepted

    # --- the compute lane ----------------------------------------------------------------------------------
    def _compute_loop(self) -> None:
        while True:
            with self._cv:
                work, wait_s = self._next_work()
                while work is None and not self._stopped:
                    self._cv.wait(wait_s)
                    work, wait_s = self._next_work()
                if work is None:
                    return
            try:
                work()
            except Exception:  # never let one batch take the lane down; its futures were settled by the runner
                logger.exception("engine work failed")

    def _next_work(self) -> tuple[Callable[[], None] | None, float | None]:
        """Lifecycle first, then the next coalesced batch, unless its coalescing window holds it: (work, None), or
        (None, how long to wait before asking again; None: until notified). Called with the lock held."""
        if self._lifecycle:
            return self._lifecycle.popleft(), None
        for model_id, unloaded in list(self._unloading.items()):
            model_queue = self._queues.get(model_id)
            if model_queue is None or (model_queue.ready and model_queue.head() is None and not model_queue.running):
                # Nothing of it can run any more: what it held in order has run.
                del self._unloading[model_id]
                self._unloaded[model_id] = None
                while len(self._unloaded) > REMEMBERED_UNLOADS:
                    self._unloaded.popitem(last=False)
                return lambda: self._unload(model_id, unloaded), None
        heads = {model: head for model, q in self._queues.items() if (head := q.head()) is not None}
        if self._samples:
            heads[SAMPLING_TURN] = self._samples[0][0]
        service = self._fair.service(heads)
        batch = next_batch(heads, self._rotation, self._token_budget, self._coalesce, service)
        if not batch:
            self._window = None
            return None, None
        hold_s = self._hold_for(batch)
        if hold_s > 0:
            return None, hold_s
        self._close_window(batch)
        if batch[0].kind == Kind.SAMPLE:
            anchor, taken = SAMPLING_TURN, self._take_samples()
        else:
            anchor, taken = batch[0].model_id, [self._queues[command.model_id].take_head() for command in batch]
        self._fair.charge((SAMPLING_TURN if command.kind == Kind.SAMPLE else command.model_id, command)
                          for command, _ in taken)
        # The anchor goes to the back of the rotation: among equals, the next turn starts with somebody else.
        self._rotation.remove(anchor)
        self._rotation.append(anchor)
        batch_models = {command.model_id for command, _ in taken}
        upcoming = [model for model in turn_order(heads, self._rotation, service)
                    if model not in batch_models and model != SAMPLING_TURN][:PREFETCH_AHEAD]
        if upcoming:
            self._prefetch(upcoming)
        return lambda: self._run(taken), None

    def _hold_for(self, batch: Sequence[Command]) -> float:
        """How much longer ``batch`` waits in its coalescing window for models in rhythm with it (0: it runs now).
        Called with the lock held; a window, once open, keeps its deadline however often this is asked."""
        anchor = batch[0]
        if self._window_cap_s <= 0 or anchor.kind not in WINDOW_KINDS:
            return 0.0
        now = self._clock()
        in_batch = {command.model_id for command in batch}
        idle = {model: self._rhythm.expected(model, anchor.kind, model_queue.idle_since_s)
                for model, model_queue in self._queues.items()
                if model not in in_batch and model not in self._unloading and model_queue.ready
                and not model_queue.has_work and model_queue.idle_since_s is not None}
        claims = False  # a less served tenant's model due, that fits only in place of others' commands
        if anchor.kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD):
            spare = self._token_budget - sum(command.tokens for command in batch)
            idle = {model: beat for model, beat in idle.items()
                    if beat is not None and beat.tokens <= spare + self._displaceable(model, batch)}
            claims = any(beat.tokens > spare for beat in idle.values())
        window = self._window
        if window is None or not window.opened_for(batch):
            pass_s = self._rhythm.pass_s(anchor.kind)
            length = (window_s(pass_s, max(self._window_cap_s, FAIR_WINDOW_CAP_S), FAIR_WINDOW_SHARE_OF_PASS)
                      if claims else window_s(pass_s, self._window_cap_s))
            window = _Window(anchor.request_id, now, now + length)
        if now >= window.deadline_s:
            return 0.0
        if not awaited(idle, now, window.deadline_s, None):
            return 0.0
        self._window = window
        return window.deadline_s - now

    def _displaceable(self, model_id: str, batch: Sequence[Command]) -> int:
        """The tokens of ``batch``'s commands a command of ``model_id`` would take the place of, beyond what the batch
        leaves of the budget: those of tenants served more than the model's own (the scheduler puts its command
        before theirs: lilo.engine.fair_share). So a pass full of one tenant's steps still waits, within its window,
        for a less served tenant's lockstep client."""
        tenant = self._tenants.get(model_id)
        own = self._fair.of(tenant) if tenant is not None else float("inf")
        return sum(command.tokens for command in batch[1:] if self._fair.of(command.tenant) > own)

    def _close_window(self, batch: Sequence[Command]) -> None:
        """``batch`` runs now: if it held a window open, that wait is a ``coalesce_wait:<kind>`` span of every
        command in it (its queue wait ends where the window opened; one that arrived meanwhile waited less)."""
        window, self._window = self._window, None
        if window is not None and window.opened_for(batch):
            self.observer.span([command.model_id for command in batch], f"coalesce_wait:{batch[0].kind}",
                               COMPUTE_LANE, window.opened_s, self._clock(),
                               request_ids=[command.request_id for command in batch], n=len(batch), ok=True)

    def _take_samples(self) -> list[tuple[Command, Future]]:
        """The oldest samples that fit the token budget together (the first always runs), or one if not
        coalescing: one generation, so training waits for at most one batch of samples per turn."""
        taken = [self._samples.popleft()]
        tokens = taken[0][0].tokens
        while self._coalesce and self._samples and tokens + self._samples[0][0].tokens <= self._token_budget:
            tokens += self._samples[0][0].tokens
            taken.append(self._samples.popleft())
        return taken

    def _run(self, taken: Sequence[tuple[Command, Future]]) -> None:
        kind = taken[0][0].kind
        if kind in SAVING_KINDS:
            self._capture_then_persist(taken[0])
            return
        # Every training model of an execution needs its slot: a batch of more models runs in parts, each next
        # part's page files read ahead on the persist lane while this part computes.
        parts = _parts(taken, self._training_models(taken), self._backend.training_slots())
        for i, part in enumerate(parts):
            if i + 1 < len(parts):
                self._prefetch(list(self._training_models(parts[i + 1])))
            self._run_part(kind, part)

    def _run_part(self, kind: Kind, taken: Sequence[tuple[Command, Future]]) -> None:
        commands = [command for command, _ in taken]
        try:
            self._make_resident(list(self._training_models(taken)), kind, _request_ids_by_model(commands))
            t0 = self._clock()
            results = self._execute(kind, commands)
        except Exception as error:  # the whole execution failed: every command in it gets the error
            t0 = self._clock()
            results = [error] * len(commands)
        t1 = self._clock()
        ok = not any(isinstance(result, BaseException) for result in results)
        if ok:
            self._rhythm.passed(kind, t1 - t0)
        self.observer.span([c.model_id for c in commands], kind, COMPUTE_LANE, t0, t1,
                           request_ids=[c.request_id for c in commands], n=len(commands), ranks=self._ranks, ok=ok)
        if kind != Kind.SAMPLE:  # samples were never any model queue's head
            self._finish_heads(commands)
        else:
            results = [self._unless_cancelled(command, result) for command, result in zip(commands, results)]
        for (_, future), result in zip(taken, results):
            self._settle(future, result)

    def _training_models(self, taken: Sequence[tuple[Command, Future]]) -> dict[str, None]:
        """The training models these commands run on, in order (a sample of a checkpoint or of the bare base
        model runs on none)."""
        with self._cv:
            return dict.fromkeys(command.model_id for command, _ in taken if command.model_id in self._queues
                                 and not getattr(command.payload, "base_only", False))

    def _make_resident(self, model_ids: Sequence[str], kind: str, request_ids: dict[str, list[str]]) -> None:
        """Page ``model_ids`` into slots (freeing one for each new model) before they run; each move is a span
        ``page_in:<kind>`` / ``page_out:<kind>`` of the model that needed it, the first carrying its request ids
        so its queue wait ends where the paging began."""
        with self._cv:
            queued = {model for model, model_queue in self._queues.items() if model_queue.has_work}
        for model_id in model_ids:
            t = self._clock()
            moves = self._backend.make_room([model_id], model_ids, queued)
            ids = request_ids.get(model_id, [])
            for move in moves:
                self.observer.span(model_id, f"page_{move.direction}:{kind}", COMPUTE_LANE, t, t + move.seconds,
                                   request_ids=ids, n=1, ok=True, moved=move.model_id, tier=move.tier)
                t, ids = t + move.seconds, []

    def _execute(self, kind: Kind, commands: Sequence[Command]) -> list[Any]:
        if kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD):
            return self._backend.forward_backward(commands, forward_only=kind == Kind.FORWARD)
        if kind == Kind.OPTIM_STEP:
            return self._backend.optim_step(commands)
        if kind == Kind.SAMPLE:
            return self._backend.sample(commands, cancelled=self._cancelled.__contains__)
        if kind == Kind.LOAD_WEIGHTS:
            return [self._backend.load_checkpoint(commands[0])]
        if kind == Kind.REFUSED:
            return [InvalidRequestError(commands[0].payload)]
        raise ValueError(f"Unknown command kind {kind!r}.")

    def _capture_then_persist(self, taken: tuple[Command, Future]) -> None:
        command, future = taken
        t0 = self._clock()
        try:
            self._make_resident([command.model_id], command.kind, {command.model_id: [command.request_id]})
            t0 = self._clock()
            captured = self._backend.capture_checkpoint(command)
        except Exception as error:
            self.observer.span(command.model_id, f"capture:{command.kind}", COMPUTE_LANE, t0, self._clock(),
                               request_ids=[command.request_id], n=1, ok=False)
            self._finish_heads([command])
            self._settle(future, error)
            return
        self.observer.span(command.model_id, f"capture:{command.kind}", COMPUTE_LANE, t0, self._clock(),
                           request_ids=[command.request_id], n=1, ok=True)
        # The state is copied out: the model's next command may run while the disk write goes on.
        self._finish_heads([command])

        def job() -> None:
            self._persist(command, captured, future)

        with self._cv:
            # Once stop() has begun, the persist lane may be past its last job: write it here, or it is never written.
            writing_here = self._stopped
            if not writing_here:
                self._persist_jobs.put(job)
        if writing_here:
            job()

    def _finish_heads(self, commands: Sequence[Command]) -> None:
        with self._cv:
            now = self._clock()
            for command in commands:
                model_queue = self._queues.get(command.model_id)
                if model_queue is not None:
                    model_queue.finish_head(now)
            self._cv.notify_all()

    def _prefetch(self, model_ids: list[str]) -> None:
        """Have the persist lane read ``model_ids``' page files ahead while the compute lane runs (one such job
        waiting at a time: a later one would only repeat it); each read is a span ``page_in:prefetch``."""
        with self._cv:
            if self._prefetching or self._stopped:
                return
            self._prefetching = True

        def job() -> None:
            t = self._clock()
            try:
                moves = self._backend.prefetch(model_ids)
            finally:
                with self._cv:
                    self._prefetching = False
            for move in moves:
                self.observer.span(move.model_id, "page_in:prefetch", PERSIST_LANE, t, t + move.seconds, n=1,
                                   ok=True, moved=move.model_id, tier=move.tier)
                t += move.seconds

        self._persist_jobs.put(job)

    # --- the persist lane ----------------------------------------------------------------------------------
    def _persist_loop(self) -> None:
        while (job := self._persist_jobs.get()) is not None:
            try:
                job()
            except Exception:
                logger.exception("persist job failed")

    def _persist(self, command: Command, captured: object, future: Future) -> None:
        t0 = self._clock()
        try:
            result: Any = self._backend.persist_checkpoint(command, captured)
        except Exception as error:
            result = error
        self.observer.span(command.model_id, f"persist:{command.kind}", PERSIST_LANE, t0, self._clock(),
                           request_ids=[command.request_id], n=1, ok=not isinstance(result, BaseException))
        self._settle(future, result)

    # --- cancelling samples ----------------------------------------------------------------------------------
    def cancel_sample(self, request_id: str) -> str:
        """Cancel a sample its client abandoned; its future fails with ``CancelledByClientError``. A queued one
        leaves the queue at once; a running one stops at its next token where the backend can (the torch sampler
        on one rank; a sharded trainer's runs to its end). Returns "queued", "running", or "none" (not here, or
        finished already)."""
        with self._cv:
            future = self._sample_futures.get(request_id)
            if future is None or future.done():
                return "none"
            for index, (command, queued) in enumerate(self._samples):
                if command.request_id == request_id:
                    del self._samples[index]
                    self._settle(queued, CancelledByClientError.of_sample(request_id))
                    return "queued"
            self._cancelled.add(request_id)
            return "running"

    def _unless_cancelled(self, command: Command, result: Any) -> Any:
        if command.request_id not in self._cancelled:
            return result
        self._cancelled.discard(command.request_id)
        return CancelledByClientError.of_sample(command.request_id)

    # --- shutdown ------------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish what is running, fail what is queued (with a message), and stop both lanes."""
        with self._cv:
            self._stopped = True
            held = [item for model_queue in self._queues.values() for item in model_queue.drain()]
            held += self._samples
            self._samples.clear()
            unloads = list(self._unloading.values())
            self._unloading.clear()
            self._cv.notify_all()
        for command, future in held:
            self._settle(future, EngineStopped(f"The trainer stopped before request {command.request_id} ran."))
        for future in unloads:
            self._settle(future, EngineStopped("The trainer stopped before the model was unloaded."))
        self._persist_jobs.put(None)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout_s)

    @staticmethod
    def _settle(future: Future, result: Any) -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def _parts(taken: Sequence[tuple[Command, Future]], models: dict[str, None],
           limit: int) -> list[Sequence[tuple[Command, Future]]]:
    """``taken`` in consecutive parts of at most ``limit`` of the training ``models`` each."""
    parts: list[Sequence[tuple[Command, Future]]] = []
    current: list[tuple[Command, Future]] = []
    seen: set[str] = set()
    for item in taken:
        model = item[0].model_id
        if model in models and model not in seen and len(seen) == limit:
            parts.append(current)
            current, seen = [], set()
        if model in models:
            seen.add(model)
        current.append(item)
    parts.append(current)
    return parts


def _request_ids_by_model(commands: Sequence[Command]) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = {}
    for command in commands:
        ids.setdefault(command.model_id, []).append(command.request_id)
    return ids
