"""The futures DB's part of each request's trace: its record, and the write of its result (``lilo.timing.traces``).

The actor's event loop answers every request of the service, so it only queues what happened; a drainer thread
makes the spans (as the trainer's ``TraceObserver`` does)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any, Sequence

from lilo.futures.store import Completion, Submission, SubmitOutcome
from lilo.timing.critical_path import DRAIN_EVERY_S, start_drainer
from lilo.timing.traces import Carrier, parent, record_span, tracer

# Requests whose trace context is kept from their record to their result; the oldest go first.
MAX_REMEMBERED = 16384
# Events waiting for the drainer; past it the oldest go.
MAX_QUEUED = 65536


class RequestTraces:
    def __init__(self, tracer_: Any, drain_every_s: float | None = DRAIN_EVERY_S) -> None:
        self._tracer = tracer_
        self._carried: OrderedDict[int, Carrier] = OrderedDict()
        self._events: deque = deque(maxlen=MAX_QUEUED)
        if drain_every_s is not None:
            start_drainer(self, drain_every_s, "lilo-futures-traces")

    @classmethod
    def if_enabled(cls) -> RequestTraces | None:
        found = tracer("futures")
        return None if found is None else cls(found)

    def recorded(self, submission: Submission, outcome: SubmitOutcome | None, start_ns: int) -> None:
        """``submission`` was recorded (``outcome``; None: refused) from ``start_ns`` until now."""
        if submission.trace:
            self._events.append((self._span_of_record, submission, outcome, start_ns, time.time_ns()))

    def completed(self, completions: Sequence[Completion], start_ns: int, written: bool) -> None:
        """``completions`` were written from ``start_ns`` until now (``written``: False, kept in the outbox)."""
        self._events.append((self._spans_of_completion, completions, start_ns, time.time_ns(), written))

    def drain(self) -> None:
        while self._events:
            make, *args = self._events.popleft()
            make(*args)

    def _span_of_record(self, submission: Submission, outcome: SubmitOutcome | None, start_ns: int,
                        end_ns: int) -> None:
        request_id = None if outcome is None else outcome.request_id
        record_span(self._tracer, "futures.record", start_ns, end_ns, parent(submission.trace),
                    ok=outcome is not None and outcome.error is None, kind=submission.kind,
                    model_id=submission.model_id, seq_id=submission.seq_id, request_id=request_id,
                    duplicate=None if outcome is None else outcome.duplicate,
                    trainer=None if outcome is None else outcome.trainer)
        if request_id is not None:
            self._carried[int(request_id)] = submission.trace
            while len(self._carried) > MAX_REMEMBERED:
                self._carried.popitem(last=False)

    def _spans_of_completion(self, completions: Sequence[Completion], start_ns: int, end_ns: int,
                             written: bool) -> None:
        for completion in completions:
            carried = (self._carried.pop(completion.request_id, None) if written
                       else self._carried.get(completion.request_id))
            if carried is not None:
                record_span(self._tracer, "futures.complete", start_ns, end_ns, parent(carried), ok=completion.ok,
                            kind=completion.kind, request_id=completion.request_id, written=written,
                            category=completion.category)
