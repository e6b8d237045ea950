"""Strict JSON request bodies: every JSON body a route reads is parsed here, so a body the rest of the service could
not store or compute with is refused up front with a sentence instead of failing deep inside (a 500).

Refused: anything that is not standard JSON (NaN, Infinity, unpaired UTF-16 surrogates, which SQLite and orjson
cannot encode), nesting deeper than ``MAX_DEPTH`` (orjson cannot write it back), and integers outside SQLite's
64-bit range. ``StrictJsonRoute`` makes a FastAPI router parse bodies this way; a refusal surfaces as FastAPI's
``json_invalid`` validation error, which ``serve.http.errors`` words for the client.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

MAX_DEPTH = 32  # Tinker bodies nest a few levels; orjson cannot serialize past 254
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body``; raises ``json.JSONDecodeError`` with a readable reason when it is refused."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise json.JSONDecodeError(f"{error.msg} (NaN, Infinity and unpaired surrogates are not JSON)",
                                   error.doc, error.pos) from None
    problem = _unstorable(value)
    if problem:
        raise json.JSONDecodeError(problem, body.decode("utf-8", "replace"), 0)
    return value


def _unstorable(value: Any) -> str | None:
    """Why the service could not store ``value``, or None. Iterative, so deep nesting costs no recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            return f"it nests deeper than {MAX_DEPTH} levels"
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:  # a bool is always within
            return f"the integer {item} does not fit in 64 bits"
    return None


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose JSON body is parsed by ``parse_json``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
