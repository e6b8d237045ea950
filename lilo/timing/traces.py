"""OpenTelemetry traces of lilo's parts: off unless the standard OTLP environment variables name a collector.

``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (its base, ``/v1/traces``
appended), set for ``lilo up``, reach every process of the cluster (``cluster.local.serve_env``). Each part then
exports OTLP/HTTP spans under its own ``service.name`` (``lilo-ingress``, ``lilo-futures``, ``lilo-trainer``,
``lilo-sampler``). Unset, ``tracer()`` is None: no provider, no exporter, no thread, and the callers skip their
spans.

One request is one trace across processes: the ingress puts its span's context (W3C ``traceparent``) on the
submission and the command (``carrier()``), and the futures DB actor and the trainer start their spans under it
(``parent()``). Export never holds a caller: finished spans go to a bounded queue that one thread drains in batches;
a full queue drops spans and a collector that is down loses the batches it refused, both counted
(``trace_export``) and logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
BASE_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
# One export's bound: a collector that does not answer costs the exporting thread this, never a step.
EXPORT_TIMEOUT_S = 2.0

# A span context as text headers (``traceparent``, maybe ``tracestate``), carried with a request through Ray.
Carrier = tuple[tuple[str, str], ...]


def traces_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """Where this process exports spans, from the standard variables; None when traces are off."""
    if environ.get(TRACES_ENDPOINT):
        return environ[TRACES_ENDPOINT]
    base = environ.get(BASE_ENDPOINT)
    return f"{base.rstrip('/')}/v1/traces" if base else None


_tracers: dict[str, Any] = {}
_processors: dict[str, Any] = {}  # per part, its BoundedExport
_lock = threading.Lock()


def tracer(part: str) -> Any:
    """The OpenTelemetry tracer of ``part`` (``ingress``, ``futures``, ``trainer``, ``sampler``) in this process,
    exporting as service ``lilo-<part>``; None when traces are off."""
    endpoint = traces_endpoint()
    if endpoint is None:
        return None
    with _lock:
        if part not in _tracers:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            from lilo.timing.trace_export import BoundedExport

            # The exporter logs every failed try of every batch; a collector that is down would flood the logs.
            # BoundedExport counts the losses and says so once.
            logging.getLogger("opentelemetry.exporter.otlp.proto.http").setLevel(logging.CRITICAL)
            provider = TracerProvider(resource=Resource.create({"service.name": f"lilo-{part}"}))
            processor = BoundedExport(OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S))
            provider.add_span_processor(processor)
            _processors[part] = processor
            _tracers[part] = provider.get_tracer("lilo")
            logger.info("lilo-%s exports traces to %s", part, endpoint)
        return _tracers[part]


def export_counts() -> dict[str, dict[str, int]]:
    """Per part of this process: spans exported, dropped and failed so far."""
    return {part: dataclasses.asdict(processor.counts) for part, processor in _processors.items()}


def carrier() -> Carrier | None:
    """The current span's context as headers to send along (None outside any recorded span)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not trace.get_current_span().is_recording():
        return None
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers)
    return tuple(headers.items())


def parent(carried: Carrier | None) -> Any:
    """The context to start a span under from what ``carrier()`` sent (None: a new trace)."""
    if not carried:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carried))


def span_context_of(context: Any) -> Any:
    """The span context a ``parent()`` context holds, for a link (None when there is none)."""
    from opentelemetry import trace

    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def set_attributes(**attributes: Any) -> None:
    """Name what the current span (the ingress's request) is about, as ``lilo.<name>``; a no-op when none records."""
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({f"lilo.{name}": value for name, value in attributes.items() if value is not None})


def record_span(tracer_: Any, name: str, start_ns: int, end_ns: int, context: Any = None,
                links: Sequence[Any] = (), ok: bool = True, **attributes: Any) -> None:
    """A span that already happened, from ``start_ns`` to ``end_ns`` (epoch nanoseconds), under ``context`` (what
    ``parent()`` made of a carrier; None: a trace of its own) and linked to the span contexts ``links``."""
    from opentelemetry.trace import Link, Status, StatusCode

    span = tracer_.start_span(name, context=context, start_time=start_ns,
                              links=[Link(context) for context in links],
                              attributes={f"lilo.{key}": value for key, value in attributes.items()
                                          if value is not None})
    if not ok:
        span.set_status(Status(StatusCode.ERROR))
    span.end(end_time=end_ns)
