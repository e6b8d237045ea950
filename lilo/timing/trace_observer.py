"""The trainer's half of a request's trace: an engine ``Observer``, composed with ``CriticalPath`` by ``Observers``.

From the same callbacks the critical path folds into numbers, this one makes OpenTelemetry spans (``traces``):
under each request's own trace (the context its command carried from the ingress) a ``queue_wait`` span from
submission to its first span on the trainer, then its share of each execution (``forward_backward``, ``capture``,
``persist``, ``page_in``...); and per coalesced execution one ``pass`` span of its own, linked to every request it
served, saying how many models, requests, tokens and ranks it held. Span times come from the engine's clock,
shifted onto the wall clock once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

from lilo.timing.critical_path import MAX_PENDING, Operation
from lilo.timing.traces import record_span, span_context_of, tracer

# Stages after which the request has more to do on the trainer (its execution, or its persist).
_NOT_LAST = frozenset({"capture", "page_in", "page_out", "coalesce_wait"})


class TraceObserver:
    def __init__(self, tracer: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._tracer = tracer
        self._clock = clock
        self._wall_offset_ns = time.time_ns() - int(clock() * 1e9)
        # request id -> (its operation, whether its queue wait was traced): until its last span.
        self._requests: OrderedDict[str, tuple[Operation, bool]] = OrderedDict()

    def _ns(self, t: float) -> int:
        return self._wall_offset_ns + int(t * 1e9)

    def register_model(self, model_id: str, spec: Any) -> None:
        pass

    def forget_model(self, model_id: str) -> None:
        pass

    def begin(self, operation: Operation) -> None:
        if not operation.trace:
            return
        self._requests[operation.request_id] = (operation, False)
        while len(self._requests) > MAX_PENDING:
            self._requests.popitem(last=False)

    def span(self, model: str | Sequence[str], name: str, lane: str, t0: float, t1: float | None = None,
             **attrs: Any) -> None:
        start, end = self._ns(t0), self._ns(self._clock() if t1 is None else t1)
        ok = attrs.get("ok", True)
        request_ids = attrs.get("request_ids", ())
        served = [(request_id, self._requests[request_id][0]) for request_id in request_ids
                  if request_id in self._requests]
        stage, _, kind = name.partition(":")
        stage, kind = (stage, kind) if kind else ("execute", name)
        for request_id, operation in served:
            if not self._requests[request_id][1]:
                record_span(self._tracer, "trainer.queue_wait", self._ns(operation.submitted_s), start,
                            operation.trace, kind=operation.kind, model_id=operation.model_id,
                            request_id=request_id)
                self._requests[request_id] = (operation, True)
            record_span(self._tracer, f"trainer.{stage}", start, end, operation.trace, ok=ok, kind=operation.kind,
                        model_id=operation.model_id, request_id=request_id, lane=lane, tier=attrs.get("tier"),
                        pass_requests=attrs.get("n"))
            if stage not in _NOT_LAST:
                self._requests.pop(request_id, None)
        if stage == "execute":  # one span per execution, linked to every request it served
            models = {model} if isinstance(model, str) else set(model)
            links = [link for _, operation in served if (link := span_context_of(operation.trace)) is not None]
            record_span(self._tracer, f"trainer.pass {kind}", start, end, links=links, ok=ok, kind=kind,
                        models=len(models), requests=attrs.get("n") or len(request_ids),
                        tokens=sum(operation.tokens for _, operation in served), ranks=attrs.get("ranks", 1))
        elif not served:  # the trainer's own work (a prefetch), or a request that came untraced
            record_span(self._tracer, f"trainer.{stage}", start, end, ok=ok, kind=kind, lane=lane,
                        moved=attrs.get("moved"), tier=attrs.get("tier"))


def trace_observer() -> TraceObserver | None:
    """The trainer's trace observer, or None when traces are off (``traces.tracer``)."""
    found = tracer("trainer")
    return None if found is None else TraceObserver(found)
