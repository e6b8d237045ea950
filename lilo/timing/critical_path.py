"""Always-on critical-path timing for a trainer: where each model's time went, per phase.

The engine reports what it does through the ``Observer`` protocol and nothing else; ``CriticalPath`` is one
observer, composed with whatever other observer the engine is given (``Observers``), so it cannot be switched off.

Phases per model (and for ``ALL_MODELS``), each with ``count, total_s, mean_s, max_s, mean_batch, mean_ranks``:
- ``<kind>.execute``: wall time of each backend execution holding the model (a coalesced batch's wall time is
  credited to every model in it; ``mean_batch`` is how many commands shared it, ``mean_ranks`` how many processes
  ran it: the ranks of a trainer that spans several devices). Recorded on failure too.
- ``<kind>.queue_wait``: submission to the start of the command's first span, split into ``queue_wait_self``
  (the lane ran batches holding an earlier command of this model), ``queue_wait_others`` (it ran batches holding
  none of this model's commands) and ``queue_wait_idle`` (it ran nothing: pure service overhead); the three add up.
  ``queue_wait_other_tenants``: the part of ``queue_wait_others`` behind batches holding no model of this model's
  tenant (the rest of it, its own tenant's other models), so a model shows whether it waited behind its own
  tenant's load or another tenant's.
- ``<kind>.coalesce_wait``: the pass that ran the command held its coalescing window open (``lilo.engine.window``)
  for other models in rhythm with it; from the window's opening, or the command's arrival if later. Counted apart
  from the queue wait (which ends where the window opened), so what the window bought can be weighed against it.
- ``<kind>.capture`` / ``<kind>.persist``: checkpoint copy-out on the compute lane, and the write on its own lane.
- ``<kind>.page_in`` / ``<kind>.page_out``: bringing the model back into a slot before its command ran, and paging
  out another (or, for a new model, ``accept.page_out``) to free that slot.
- ``accept.execute`` / ``accept.queue_wait``: making a new model ready, from its registration.
Gauges, measured from process start and set once: ``trainer.backend_ready_s``, ``trainer.serving_ready_s``,
``trainer.first_model_ready_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Protocol, Sequence

import orjson
import psutil

from lilo.tenants import LOCAL_TENANT
from lilo.timing.phase_stats import ALL_MODELS, DEFAULT_READER, QUEUE_WAIT, PhaseStats

logger = logging.getLogger(__name__)

MAX_PENDING = 4096
# Execution intervals remembered per lane, to split queue waits; a wait older than these counts as idle.
LANE_HISTORY = 4096
LOG_EVERY_S = 300.0
# How often the background drainer folds queued events into the stats.
DRAIN_EVERY_S = 0.05
LOG_EVENT = "lilo_critical_path"

BACKEND_READY = "trainer.backend_ready_s"
SERVING_READY = "trainer.serving_ready_s"
FIRST_MODEL_READY = "trainer.first_model_ready_s"


@dataclasses.dataclass(frozen=True)
class Operation:
    """A command as the engine accepted it: ``submitted_s`` is on the same clock as span times."""

    model_id: str
    request_id: str
    kind: str
    submitted_s: float
    tenant: str = LOCAL_TENANT
    tokens: int = 0
    trace: tuple[tuple[str, str], ...] | None = None  # its request's trace context (``lilo.timing.traces``)


class Observer(Protocol):
    def register_model(self, model_id: str, spec: Any) -> None: ...

    def forget_model(self, model_id: str) -> None: ...

    def begin(self, operation: Operation) -> None: ...

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None: ...


class Observers:
    """Fan-out to several observers; one that raises is logged and never reaches the engine or the others."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args, **kwargs)
            except Exception:
                logger.exception("observer %s failed in %s; the engine goes on", type(observer).__name__, method)

    def register_model(self, model_id: str, spec: Any) -> None:
        self._each("register_model", model_id, spec)

    def forget_model(self, model_id: str) -> None:
        self._each("forget_model", model_id)

    def begin(self, operation: Operation) -> None:
        self._each("begin", operation)

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None:
        self._each("span", model, name, lane, t0, t1, **attrs)


_PHASES: dict[str, str] = {}
_WAIT_PHASES: dict[str, str] = {}


def phase_of(span_name: str) -> str:
    """``forward_backward`` -> ``forward_backward.execute``; ``capture:save_weights`` -> ``save_weights.capture``."""
    stage, sep, kind = span_name.partition(":")
    return f"{kind}.{stage}" if sep else f"{span_name}.execute"


def split_wait(history: Sequence[tuple[float, float, tuple[str, ...], frozenset[str]]], model_id: str,
               submitted: float, started: float,
               tenant: str = LOCAL_TENANT) -> tuple[float, float, float, float, float]:
    """(wait, self, others, idle, other tenants) of a command of ``model_id`` (of ``tenant``) waiting on a lane from
    ``submitted`` to ``started``: the last is the part of ``others`` spent behind passes holding no model of its
    own tenant (so whether it waited behind its tenant's own load or someone else's).

    ``history`` holds the lane's executions as (t0, t1, models, their tenants) in the order they ended; executions
    are serialized on a lane, so the overlaps never count the same second twice.
    """
    wait = max(0.0, started - submitted)
    own = others = strangers = 0.0
    for t0, t1, models, tenants in reversed(history):
        if t1 <= submitted:
            break
        overlap = min(t1, started) - max(t0, submitted)
        if overlap > 0:
            if model_id in models:
                own += overlap
            else:
                others += overlap
                if tenant not in tenants:
                    strangers += overlap
    own = min(own, wait)
    others = min(others, wait - own)
    return wait, own, others, wait - own - others, min(strangers, others)


def _process_start_wall_s() -> float:
    return psutil.Process().create_time()


class CriticalPath:
    """The Observer that keeps the per-model breakdown. Bounded: MAX_SERIES models, MAX_PENDING stamps.

    The engine's threads only append events to a queue (a few hundred ns); a background drainer, and every
    reader before it reads, folds them into the stats, so a snapshot always includes every span reported before it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 process_start_wall_s: float | None = None, log_line: Callable[[str], None] | None = None,
                 log_every_s: float = LOG_EVERY_S, drain_every_s: float | None = DRAIN_EVERY_S) -> None:
        self.stats = PhaseStats()
        self._clock = clock
        self._wall_clock = wall_clock
        self._process_start = _process_start_wall_s() if process_start_wall_s is None else process_start_wall_s
        self._log_line = log_line or (lambda line: print(line, file=sys.stdout, flush=True))
        self._log_every_s = log_every_s
        # deque.append and popleft are atomic, so the engine's threads append without taking the lock.
        self._events: deque = deque()
        self._pending: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        self._accepts: dict[str, float] = {}
        self._tenants: dict[str, str] = {}  # model -> its tenant, as its latest command said (for the wait split)
        self._lanes: dict[str, deque] = {}
        self._gauges: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_aggregate_read = self._last_log = clock()
        if drain_every_s is not None:
            start_drainer(self, drain_every_s)

    # --- Observer: the engine's hot path, enqueue only -----------------------------------------------------
    def register_model(self, model_id: str, spec: Any) -> None:
        self._events.append((_REGISTER, model_id, self._clock()))

    def forget_model(self, model_id: str) -> None:
        self._events.append((_FORGET, model_id))

    def begin(self, operation: Operation) -> None:
        self._events.append((_BEGIN, operation))

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None:
        # Startup gauges are wall-clock facts of the moment the span is reported, not of when it is drained.
        wall_now = self._wall_clock() if name == "accept" else None
        self._events.append((_SPAN, model, name, lane, t0, self._clock() if t1 is None else t1, attrs, wall_now))

    # --- folding events into the stats ---------------------------------------------------------------------
    def drain(self) -> None:
        """Fold every queued event into the stats (readers call this first; so does the background drainer)."""
        with self._lock:
            events, pop = self._events, self._events.popleft
            while events:
                event = pop()
                kind = event[0]
                if kind is _SPAN:
                    self._fold_span(*event[1:])
                elif kind is _BEGIN:
                    operation = event[1]
                    self._pending[operation.request_id] = (operation.model_id, operation.kind, operation.submitted_s)
                    self._tenants[operation.model_id] = operation.tenant
                    if len(self._pending) > MAX_PENDING:
                        self._pending.popitem(last=False)
                elif kind is _REGISTER:
                    self._accepts[event[1]] = event[2]
                else:
                    self._fold_forget(event[1])
            last_span_end = self._clock()
        if last_span_end - self._last_log >= self._log_every_s:
            self._maybe_log(last_span_end)

    def _fold_span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float,
                   attrs: dict, wall_now: float | None) -> None:
        models = (model,) if isinstance(model, str) else tuple(dict.fromkeys(model))
        request_ids = attrs.get("request_ids", ())
        batch = attrs.get("n") or len(request_ids) or len(models)
        ranks = attrs.get("ranks", 1)
        phase = _PHASES.get(name) or _PHASES.setdefault(name, phase_of(name))
        history = self._lanes.get(lane)
        if history is None:
            history = self._lanes[lane] = deque(maxlen=LANE_HISTORY)
        observations = []
        # A model's part of the span starts when its command arrived, if that was later (a coalescing window
        # that it joined while open); every other span starts after its commands arrived.
        starts: dict[str, float] = {}
        for request_id in request_ids:
            entry = self._pending.pop(request_id, None)
            if entry is not None:
                model_id, kind, submitted = entry
                starts[model_id] = max(t0, submitted)
                wait_phase = _WAIT_PHASES.get(kind) or _WAIT_PHASES.setdefault(kind, f"{kind}.{QUEUE_WAIT}")
                split = split_wait(history, model_id, submitted, t0, self._tenant_of(model_id))
                observations.append((model_id, wait_phase, split, batch, 1))
        observations += [(model_id, phase, (t1 - starts.get(model_id, t0),), batch, ranks) for model_id in models]
        if name == "accept":
            for model_id in models:
                registered = self._accepts.pop(model_id, None)
                if registered is not None:
                    split = split_wait(history, model_id, registered, t0, self._tenant_of(model_id))
                    observations.append((model_id, f"accept.{QUEUE_WAIT}", split, batch, 1))
            if attrs.get("ok", True) and FIRST_MODEL_READY not in self._gauges:
                self._gauges[FIRST_MODEL_READY] = wall_now - self._process_start
        history.append((t0, t1, models, frozenset(self._tenant_of(model_id) for model_id in models)))
        self.stats.record_many(observations)

    def _tenant_of(self, model_id: str) -> str:
        return self._tenants.get(model_id, LOCAL_TENANT)

    def _fold_forget(self, model_id: str) -> None:
        self._accepts.pop(model_id, None)
        self._tenants.pop(model_id, None)
        for request_id in [rid for rid, entry in self._pending.items() if entry[0] == model_id]:
            del self._pending[request_id]
        self.stats.forget(model_id)

    # --- gauges and reading --------------------------------------------------------------------------------
    def mark(self, gauge: str) -> None:
        """Set a startup gauge (seconds since process start) the first time it is marked."""
        with self._lock:
            self._gauges.setdefault(gauge, self._wall_clock() - self._process_start)

    def snapshot(self, model_id: str | None = None, reset: bool = False, reader: str = DEFAULT_READER) -> dict:
        model = model_id or ALL_MODELS
        if model == ALL_MODELS:
            self._last_aggregate_read = self._clock()
        self.drain()
        return self._snapshot(model, reset, reader)

    def gauges(self) -> dict[str, float]:
        self.drain()
        with self._lock:
            return dict(self._gauges)

    def _snapshot(self, model: str, reset: bool, reader: str) -> dict:
        with self._lock:
            gauges = dict(self._gauges)
        return {
            "model_id": model,
            "uptime_s": self._wall_clock() - self._process_start,
            "phases": self.stats.stats(model, reader=reader, reset=reset),
            "gauges": gauges,
        }

    def _maybe_log(self, now: float) -> None:
        """One JSON line per LOG_EVERY_S for the aggregate, unless somebody read the aggregate meanwhile."""
        self._last_log = now
        if now - self._last_aggregate_read < self._log_every_s:
            return
        snapshot = self._snapshot(ALL_MODELS, reset=True, reader=LOG_EVENT)
        self._log_line(orjson.dumps({"event": LOG_EVENT, **snapshot}).decode())


_SPAN, _BEGIN, _REGISTER, _FORGET = "span", "begin", "register", "forget"


def start_drainer(path: Any, every_s: float, name: str = "lilo-critical-path") -> None:
    """A daemon thread that calls ``path.drain()`` every ``every_s``; it holds only a weak reference and ends with
    it."""
    ref = weakref.ref(path)

    def loop() -> None:
        while True:
            time.sleep(every_s)
            target = ref()
            if target is None:
                return
            try:
                target.drain()
            except Exception:
                logger.exception("%s: a drain failed; timing goes on", name)
            del target

    threading.Thread(target=loop, name=name, daemon=True).start()


def flatten(snapshot: dict, prefix: str = "lilo") -> dict[str, float]:
    """``{"<prefix>/uptime_s", "<prefix>/<phase>.<stat>", "<prefix>/<gauge>"}`` scalars, for W&B or a JSON line."""
    flat = {f"{prefix}/uptime_s": snapshot["uptime_s"]}
    for phase, stats in snapshot["phases"].items():
        for stat, value in stats.items():
            flat[f"{prefix}/{phase}.{stat}"] = value
    for gauge, value in snapshot["gauges"].items():
        flat[f"{prefix}/{gauge}"] = value
    return flat
