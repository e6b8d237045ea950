"""Gates in front of every route, each answering with a sentence: ``BodyLimit`` (one body-size limit; a larger
request is a 413, refused before it is read whole: by its Content-Length, or as soon as a body sent without one
passes the limit) and ``JsonOnly`` (a body declared as anything but JSON is a 415, except where protobuf is the
format)."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Sequence

from fastapi import HTTPException

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 64 << 20


def too_large(limit: int) -> str:
    return (f"The request body is over this server's limit of {limit} bytes (LILO_MAX_BODY_MB); send smaller "
            "requests (the SDK already splits large forward_backward batches into chunks).")


class BodyLimit:
    """ASGI middleware; the ingress sets ``limit_bytes`` from its settings when it starts."""

    limit_bytes = DEFAULT_MAX_BODY_BYTES

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = BodyLimit.limit_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await answer(send, 413, too_large(limit))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a body without a (true) Content-Length: stop reading it here
                raise HTTPException(status_code=413, detail=too_large(limit))
            return message

        await self.app(scope, counted, send)


class JsonOnly:
    """A POST body whose Content-Type is set and is not JSON gets a 415, except on the protobuf routes (which check
    their own type); a body without a Content-Type is read as JSON."""

    def __init__(self, app: ASGIApp, protobuf_paths: frozenset[str]) -> None:
        self.app = app
        self.protobuf_paths = protobuf_paths

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] not in self.protobuf_paths:
            declared = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
            media = declared.split(";", 1)[0].strip().lower()
            if media and media != "application/json" and not media.endswith("+json"):
                await answer(send, 415, f"This endpoint takes an application/json body, not {media}.")
                return
        await self.app(scope, receive, send)


async def answer(send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer a request from middleware: ``{"detail": ...}``, as every other error is."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
