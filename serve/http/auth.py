"""The API key gate in front of every route: a request under a keyed prefix (``KeyedRoutes``: the Tinker API's
/api/v1, the OpenAI-compatible /oai/api/v1) without a valid key is a 401 with a sentence, answered before its body is
read, in the shape that prefix's clients read; the tenant of a valid one is left in the ASGI scope for the route
(``caller``). The audiences register their prefixes when the app is composed (serve.app), so this layer knows none."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import Request

from lilo.api_keys import HEADER, ApiKeys, Unauthorized
from lilo.session_tokens import InvalidToken, SessionTokens, looks_like_token
from serve.http.limits import ASGIApp, Receive, Send, answer

TENANT_SCOPE_KEY = "lilo.tenant"
_HEADER_BYTES = HEADER.lower().encode()
_BEARER = "bearer "
Headers = dict[bytes, bytes]


def header_key(headers: Headers) -> str:
    """The key of the X-API-Key header, as the tinker SDK sends it ("" without one)."""
    return headers.get(_HEADER_BYTES, b"").decode("latin-1")


def bearer_key(headers: Headers) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" without one)."""
    value = headers.get(b"authorization", b"").decode("latin-1").strip()
    return value[len(_BEARER):].strip() if value.lower().startswith(_BEARER) else ""


async def refuse_plain(send: Send, message: str) -> None:
    """A 401 as the Tinker API answers every error: ``{"detail": ...}``, naming the header a key goes in."""
    await answer(send, 401, message, [(b"www-authenticate", HEADER.encode())])


async def refuse_token(send: Send, message: str) -> None:
    """A 401 for a token that is not (or no longer) good, marked so that the SDK exchanges its key again and
    replays the request (RFC 6750's ``invalid_token``)."""
    await answer(send, 401, message, [(b"www-authenticate", b'Bearer error="invalid_token"')])


@dataclass(frozen=True)
class KeyedRoutes:
    """The routes under ``prefix`` need a key, read by ``read_key``; a refusal is answered by ``refuse``.
    ``open_paths`` and ``open_prefixes`` under it need none."""

    prefix: str
    refuse: Callable[[Send, str], Awaitable[None]] = refuse_plain
    read_key: Callable[[Headers], str] = header_key
    open_paths: frozenset[str] = frozenset()
    open_prefixes: tuple[str, ...] = ()

    def gates(self, path: str) -> bool:
        return (path.startswith(self.prefix) and path not in self.open_paths
                and not path.startswith(self.open_prefixes))


class ApiKeyGate:
    """ASGI middleware over the given ``KeyedRoutes``; the ingress sets ``keys`` from its deployment arguments when
    it starts."""

    keys = ApiKeys({})
    tokens: SessionTokens | None = None  # set with the cluster's secret when the ingress starts

    def __init__(self, app: ASGIApp, routes: tuple[KeyedRoutes, ...]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        keyed = self._keyed(scope)
        if keyed is not None:
            try:
                scope[TENANT_SCOPE_KEY] = self.tenant_for(keyed.read_key(dict(scope.get("headers") or [])))
            except InvalidToken as refusal:
                await refuse_token(send, str(refusal))
                return
            except Unauthorized as refusal:
                await keyed.refuse(send, str(refusal))
                return
        await self.app(scope, receive, send)

    @staticmethod
    def tenant_for(credential: str) -> str:
        """The tenant of an API key, or of a token one was exchanged for (``lilo.session_tokens``)."""
        if ApiKeyGate.tokens is not None and looks_like_token(credential):
            return ApiKeyGate.tokens.tenant_for(credential, time.time())
        return ApiKeyGate.keys.tenant_for(credential)

    def _keyed(self, scope: dict[str, Any]) -> KeyedRoutes | None:
        if scope["type"] != "http":
            return None
        path = scope.get("path", "")
        return next((routes for routes in self.routes if routes.gates(path)), None)


async def caller(request: Request) -> str:
    """The tenant the gate found for this request (a route dependency). Async, like every route of the ingress:
    FastAPI runs a plain function in a thread pool, and each such hop costs anyio a walk over every task of the
    event loop, which with thousands of parked ``retrieve_future`` long-polls took a third of the ingress's CPU."""
    return request.scope[TENANT_SCOPE_KEY]
