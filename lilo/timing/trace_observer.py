"""The trainer's half of a request's trace: an engine ``Observer``, composed with ``CriticalPath`` by ``Observers``.

From the same callbacks the critical path folds into numbers, this one makes OpenTelemetry spans (``traces``):
under each request's own trace (the context its command carried from the ingress) a ``queue_wait`` span from
submission to its first span on the trainer, then its share of each execution (``forward_backward``, ``capture``,
``persist``, ``page_in``...); and per coalesced execution one ``pass`` span of its own, linked to every request it
served, saying how many models, requests, tokens and ranks it held. Span times come from the engine's clock,
shifted onto the wall clock once.

As with the critical path, the engine's threads only append to a queue; a drainer thread makes the spans (and the
exporter's own thread sends them), so a trainer pays the same few hundred nanoseconds per call with traces on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Sequence

from lilo.timing.critical_path import DRAIN_EVERY_S, MAX_PENDING, Operation, start_drainer
from lilo.timing.traces import parent, record_span, span_context_of, tracer

logger = logging.getLogger(__name__)

# Stages after which the request has more to do on the trainer (its execution, or its persist).
_NOT_LAST = frozenset({"capture", "page_in", "page_out", "coalesce_wait"})


# Calls waiting for the drainer; past it the oldest are dropped (counted) rather than the engine ever waiting.
MAX_QUEUED_CALLS = 65536


class TraceObserver:
    def __init__(self, tracer: Any, clock: Callable[[], float] = time.monotonic,
                 drain_every_s: float | None = DRAIN_EVERY_S) -> None:
        self._tracer = tracer
        self._clock = clock
        self._wall_offset_ns = time.time_ns() - int(clock() * 1e9)
        self._calls: deque = deque()  # appended without a lock: deque.append and popleft are atomic
        self._draining = threading.Lock()  # one drainer at a time, so a request's calls fold in order
        self.dropped = 0
        # request id -> its operation, the context its spans go under and the span context for a pass's link to it,
        # and whether its queue wait was traced: from its begin until its last span.
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        if drain_every_s is not None:
            start_drainer(self, drain_every_s, "lilo-trace-observer")

    def _ns(self, t: float) -> int:
        return self._wall_offset_ns + int(t * 1e9)

    def register_model(self, model_id: str, spec: Any) -> None:
        pass

    def forget_model(self, model_id: str) -> None:
        pass

    # --- Observer: the engine's hot path, enqueue only -----------------------------------------------------
    def begin(self, operation: Operation) -> None:
        if operation.trace:
            self._enqueue((operation,))

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None:
        self._enqueue((model, name, lane, t0, self._clock() if t1 is None else t1, attrs))

    def _enqueue(self, call: tuple) -> None:
        self._calls.append(call)
        if len(self._calls) > MAX_QUEUED_CALLS:  # a drainer that cannot keep up: the oldest go
            self._calls.popleft()
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("trace observer: more than %d calls wait for its drainer; the oldest are dropped",
                               MAX_QUEUED_CALLS)

    # --- the drainer ---------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Make the spans of every call queued so far."""
        with self._draining:
            while self._calls:
                call = self._calls.popleft()
                if len(call) == 1:
                    self._fold_begin(*call)
                else:
                    self._fold_span(*call[:5], **call[5])

    def _fold_begin(self, operation: Operation) -> None:
        context = parent(operation.trace)
        self._requests[operation.request_id] = _Request(operation, context, span_context_of(context))
        while len(self._requests) > MAX_PENDING:
            self._requests.popitem(last=False)

    def _fold_span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float,
                   **attrs: Any) -> None:
        start, end = self._ns(t0), self._ns(t1)
        ok = attrs.get("ok", True)
        request_ids = attrs.get("request_ids", ())
        served = [self._requests[request_id] for request_id in request_ids if request_id in self._requests]
        stage, _, kind = name.partition(":")
        stage, kind = (stage, kind) if kind else ("execute", name)
        for request in served:
            operation = request.operation
            if not request.waited:
                record_span(self._tracer, "trainer.queue_wait", self._ns(operation.submitted_s), start,
                            request.context, kind=operation.kind, model_id=operation.model_id,
                            request_id=operation.request_id)
                request.waited = True
            record_span(self._tracer, f"trainer.{stage}", start, end, request.context, ok=ok, kind=operation.kind,
                        model_id=operation.model_id, request_id=operation.request_id, lane=lane,
                        tier=attrs.get("tier"), pass_requests=attrs.get("n"))
            if stage not in _NOT_LAST:
                self._requests.pop(operation.request_id, None)
        if stage == "execute":  # one span per execution, linked to every request it served
            models = {model} if isinstance(model, str) else set(model)
            record_span(self._tracer, f"trainer.pass {kind}", start, end,
                        links=[request.link for request in served if request.link is not None], ok=ok, kind=kind,
                        models=len(models), requests=attrs.get("n") or len(request_ids),
                        tokens=sum(request.operation.tokens for request in served), ranks=attrs.get("ranks", 1))
        elif not served:  # the trainer's own work (a prefetch), or a request that came untraced
            record_span(self._tracer, f"trainer.{stage}", start, end, ok=ok, kind=kind, lane=lane,
                        moved=attrs.get("moved"), tier=attrs.get("tier"))


@dataclasses.dataclass
class _Request:
    operation: Operation
    context: Any
    link: Any
    waited: bool = False


def trace_observer() -> TraceObserver | None:
    """The trainer's trace observer, or None when traces are off (``traces.tracer``)."""
    found = tracer("trainer")
    return None if found is None else TraceObserver(found)
