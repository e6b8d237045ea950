"""The OpenAI-compatible routes' keys: taken as OpenAI's clients send them, Authorization: Bearer, or as the tinker
SDK does, X-API-Key; refused in OpenAI's error shape, with a hint for the openai client."""

from __future__ import annotations

from serve.http.auth import Headers, KeyedRoutes, bearer_key, header_key
from serve.http.limits import Send
from serve.openai.errors import answer_openai

OPENAI_PREFIX = "/oai/api/v1/"
OPENAI_KEY_HINT = ("The openai client sends its api_key as the Authorization: Bearer header: OpenAI(base_url=..., "
                   "api_key='tml-...').")


def openai_key(headers: Headers) -> str:
    return header_key(headers) or bearer_key(headers)


async def refuse_openai(send: Send, message: str) -> None:
    await answer_openai(send, 401, f"{message} {OPENAI_KEY_HINT}", "invalid_api_key")


OPENAI_ROUTES = KeyedRoutes(OPENAI_PREFIX, refuse=refuse_openai, read_key=openai_key)
