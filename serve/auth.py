"""The API key gate in front of every route: a request under /api/v1 (or the OpenAI-compatible /oai/api/v1) without a
valid key is a 401 with a sentence, answered before its body is read; the tenant of a valid one is left in the ASGI
scope for the route (``caller``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from lilo.api_keys import HEADER, ApiKeys, Unauthorized
from serve.limits import ASGIApp, Receive, Send, answer
from serve.openai_errors import answer_openai

API_PREFIX = "/api/v1/"
# Open without a key: what a health check, or the SDK before it authenticates, asks. (/docs and /openapi.json lie
# outside /api/v1 and are open too: the schema is no secret.)
OPEN_PATHS = frozenset({"/api/v1/healthz", "/api/v1/client/config", "/api/v1/get_server_capabilities"})
# Signed download links (lilo.signed_urls): fetched without a key (urllib sends none); the route checks the signature.
OPEN_PREFIXES = ("/api/v1/downloads/",)
# The OpenAI-compatible routes (serve/openai.py) take the key as OpenAI's clients send it, Authorization: Bearer, or
# as the tinker SDK does; their refusals are in OpenAI's error shape.
OPENAI_PREFIX = "/oai/api/v1/"
OPENAI_KEY_HINT = ("The openai client sends its api_key as the Authorization: Bearer header: OpenAI(base_url=..., "
                   "api_key='tml-...').")
TENANT_SCOPE_KEY = "lilo.tenant"
_HEADER_BYTES = HEADER.lower().encode()
_BEARER = "bearer "


class ApiKeyGate:
    """ASGI middleware; the ingress sets ``keys`` from its deployment arguments when it starts."""

    keys = ApiKeys({})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        openai = path.startswith(OPENAI_PREFIX)
        if scope["type"] == "http" and (openai or (path.startswith(API_PREFIX) and path not in OPEN_PATHS
                                                   and not path.startswith(OPEN_PREFIXES))):
            headers = dict(scope.get("headers") or [])
            key = headers.get(_HEADER_BYTES, b"").decode("latin-1") or (bearer_key(headers) if openai else "")
            try:
                scope[TENANT_SCOPE_KEY] = ApiKeyGate.keys.tenant_for(key)
            except Unauthorized as refusal:
                if openai:
                    await answer_openai(send, 401, f"{refusal} {OPENAI_KEY_HINT}", "invalid_api_key")
                else:
                    await answer(send, 401, str(refusal), [(b"www-authenticate", HEADER.encode())])
                return
        await self.app(scope, receive, send)


def bearer_key(headers: dict[bytes, bytes]) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" without one)."""
    value = headers.get(b"authorization", b"").decode("latin-1").strip()
    return value[len(_BEARER):].strip() if value.lower().startswith(_BEARER) else ""


async def caller(request: Request) -> str:
    """The tenant the gate found for this request (a route dependency). Async, like every route of the ingress:
    FastAPI runs a plain function in a thread pool, and each such hop costs anyio a walk over every task of the
    event loop, which with thousands of parked ``retrieve_future`` long-polls took a third of the ingress's CPU."""
    return request.scope[TENANT_SCOPE_KEY]
