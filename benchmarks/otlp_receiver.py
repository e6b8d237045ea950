"""A real OTLP/HTTP trace receiver on loopback, for tests and benchmarks: it decodes each export with
``opentelemetry-proto`` and keeps the spans, as a collector would receive them."""

from __future__ import annotations

import dataclasses
import gzip
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

MAX_SPANS = 200_000


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each
    attributes: dict
    start_ns: int
    end_ns: int
    error: bool


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: deque[ReceivedSpan] = deque(maxlen=MAX_SPANS)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            service = next((_value(a.value) for a in resource_spans.resource.attributes if a.key == "service.name"),
                           "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        {a.key: _value(a.value) for a in span.attributes}, span.start_time_unix_nano,
                        span.end_time_unix_nano, span.status.code == 2))

    def wait_for(self, enough: Callable[[list[ReceivedSpan]], object],
                 timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans received, once ``enough(spans)`` (or the timeout passed: the parts export every half second
        or so)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = list(self.spans)
            if enough(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def spans_between(self, start_ns: int, end_ns: int, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The spans that started between the two times, once one that started later has come (what was exported
        before it is in: each part exports in order)."""
        spans = self.wait_for(lambda spans: any(span.start_ns > end_ns for span in spans), timeout_s)
        return [span for span in spans if start_ns <= span.start_ns <= end_ns]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
