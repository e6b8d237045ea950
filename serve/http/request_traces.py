"""The ingress's span of each request (``lilo.timing.traces``): the root of the request's trace, which the futures DB
and the trainer continue. Added only when traces are on (``serve.app``)."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Send

from lilo.tenants import tenant_of
from lilo.timing.traces import tracer
from serve.http.auth import TENANT_SCOPE_KEY

# A client's steady background calls, each its own trace of nothing: the heartbeat, the SDK's telemetry, health
# checks, and the long-polls of retrieve_future (one open per waiting future, answered from the futures DB).
UNTRACED_PATHS = frozenset({"/api/v1/healthz", "/api/v1/session_heartbeat", "/api/v1/telemetry",
                            "/api/v1/retrieve_future"})


class TraceRequests:
    """ASGI middleware: one server span per request, named by its route, with its status (an error from 500 on);
    the route's handler adds what it learns (model, seq id, request id: ``traces.set_attributes``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tracer: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        if self._tracer is None:
            self._tracer = tracer("ingress")
        method = scope.get("method", "")
        with self._tracer.start_as_current_span(f"{method} {path}", kind=SpanKind.SERVER,
                                                attributes={"http.request.method": method,
                                                            "url.path": path}) as span:
            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, sending)
            finally:
                route = scope.get("route")
                if route is not None and hasattr(route, "path"):  # the template: one name per route, not per id
                    span.update_name(f"{method} {route.path}")
                    span.set_attribute("http.route", route.path)
                if TENANT_SCOPE_KEY in scope:
                    span.set_attribute("lilo.tenant", tenant_of(scope[TENANT_SCOPE_KEY]))
