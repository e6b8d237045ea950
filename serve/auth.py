"""The API key gate in front of every route: a request under /api/v1 without a valid key is a 401 with a sentence,
answered before its body is read; the tenant of a valid one is left in the ASGI scope for the route (``caller``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from lilo.api_keys import HEADER, ApiKeys, Unauthorized
from serve.limits import ASGIApp, Receive, Send, answer

API_PREFIX = "/api/v1/"
# Open without a key: what a health check, or the SDK before it authenticates, asks. (/docs and /openapi.json lie
# outside /api/v1 and are open too: the schema is no secret.)
OPEN_PATHS = frozenset({"/api/v1/healthz", "/api/v1/client/config", "/api/v1/get_server_capabilities"})
# Signed download links (lilo.signed_urls): fetched without a key (urllib sends none); the route checks the signature.
OPEN_PREFIXES = ("/api/v1/downloads/",)
TENANT_SCOPE_KEY = "lilo.tenant"
_HEADER_BYTES = HEADER.lower().encode()


class ApiKeyGate:
    """ASGI middleware; the ingress sets ``keys`` from its deployment arguments when it starts."""

    keys = ApiKeys({})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and path.startswith(API_PREFIX) and path not in OPEN_PATHS
                and not path.startswith(OPEN_PREFIXES)):
            key = dict(scope.get("headers") or []).get(_HEADER_BYTES, b"").decode("latin-1")
            try:
                scope[TENANT_SCOPE_KEY] = ApiKeyGate.keys.tenant_for(key)
            except Unauthorized as refusal:
                await answer(send, 401, str(refusal), [(b"www-authenticate", HEADER.encode())])
                return
        await self.app(scope, receive, send)


async def caller(request: Request) -> str:
    """The tenant the gate found for this request (a route dependency). Async, like every route of the ingress:
    FastAPI runs a plain function in a thread pool, and each such hop costs anyio a walk over every task of the
    event loop, which with thousands of parked ``retrieve_future`` long-polls took a third of the ingress's CPU."""
    return request.scope[TENANT_SCOPE_KEY]
