"""The one place where errors become HTTP responses: a status per library error type, and every error body one JSON
object whose ``detail`` is a sentence saying what to change (``ErrorBody``, documented for every route as 4XX and
503)."""

from __future__ import annotations

import http
import math
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lilo.errors import (
    ConflictError, ForbiddenError, GoneError, InvalidRequestError, LiloError, NotFoundError, QuotaExceededError,
    SaturatedError, TooLargeError, UnavailableError,
)

STATUS_BY_ERROR: dict[type[LiloError], int] = {
    InvalidRequestError: 422,
    NotFoundError: 404,
    ForbiddenError: 403,
    QuotaExceededError: 403,
    GoneError: 410,
    ConflictError: 409,
    SaturatedError: 429,
    UnavailableError: 503,
    TooLargeError: 413,
}
MAX_LISTED_ERRORS = 5  # a validation sentence names this many fields at most


class ErrorBody(BaseModel):
    detail: str = Field(min_length=1, description="what is wrong and what to change, as a sentence")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "The request was refused; `detail` says what to change."},
    503: {"model": ErrorBody, "description": "Something it needs is being restarted; retry shortly."},
}


def status_for(error: LiloError) -> int:
    for kind, status in STATUS_BY_ERROR.items():
        if isinstance(error, kind):
            return status
    return 400


def validation_sentence(errors: Sequence[Any]) -> str:
    """FastAPI's list of validation errors as one sentence naming each field and what is wrong with it."""
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "it could not be parsed")
            return f"The request body is not valid JSON: {reason}; send one JSON object."
    parts = []
    for error in errors[:MAX_LISTED_ERRORS]:
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - MAX_LISTED_ERRORS} more)" if len(errors) > MAX_LISTED_ERRORS else ""
    return f"The request is not valid: {'; '.join(parts)}{more}. Fix these and send it again."


def bare_phrase_sentence(request: Request, error: StarletteHTTPException) -> str | None:
    """A sentence for the errors Starlette raises with only the status phrase as detail (unknown route, wrong
    method); None when the detail is already the route's own message."""
    try:
        if error.detail != http.HTTPStatus(error.status_code).phrase:
            return None
    except ValueError:  # a status Python does not name: the route chose its own detail
        return None
    if error.status_code == 404:
        return f"There is no {request.url.path} here; the Tinker API is under /api/v1 (see /docs)."
    if error.status_code == 405:
        headers = {name.lower(): value for name, value in (error.headers or {}).items()}
        allowed = headers.get("allow", "another method")
        return f"{request.url.path} does not take {request.method}; use {allowed}."
    return f"The request was refused ({error.detail}); see /docs for what this route takes."


def install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(LiloError)
    async def lilo_error(_request: Request, error: LiloError) -> JSONResponse:
        # Errors raised inside a Ray actor arrive wrapped; the client gets the sentence, not the traceback.
        cause = getattr(error, "cause", None) or error
        retry_after = getattr(cause, "retry_after_s", None)  # a rate limit: the SDK waits this long, then retries
        headers = {"Retry-After": f"{max(1, math.ceil(retry_after))}"} if retry_after is not None else None
        return JSONResponse(status_code=status_for(error), content={"detail": str(cause)}, headers=headers)

    @api.exception_handler(RayActorError)
    async def actor_gone(_request: Request, error: RayActorError) -> JSONResponse:
        # A trainer or the futures DB died under the request; Ray is restarting it. The SDK retries a 503 by
        # itself, and a retried submission with the same seq_id finds what was recorded, never runs twice.
        return JSONResponse(status_code=503, content={
            "detail": "A lilo actor this request needed stopped while serving it and is being restarted; retry in "
                      "a few seconds."})

    @api.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": validation_sentence(error.errors())})

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        sentence = bare_phrase_sentence(request, error)
        if sentence is not None:
            error = StarletteHTTPException(error.status_code, sentence, error.headers)
        return await http_exception_handler(request, error)
