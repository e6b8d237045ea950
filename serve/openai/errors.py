"""Errors of the OpenAI-compatible routes in OpenAI's own shape, ``{"error": {"message", "type", "param", "code"}}``
(the ``openai`` package reads it into ``openai.BadRequestError`` and its siblings), each message a sentence saying
what to change. ``OpenAIRoute`` answers every error of its route that way: bad parameters are a 400 (OpenAI's
status for them, not FastAPI's 422), an unknown model a 404 ``model_not_found``."""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lilo.errors import InvalidRequestError, LiloError, NotFoundError
from serve.http.errors import status_for, validation_sentence
from serve.http.json_body import StrictJsonRoute
from serve.http.limits import Send

# OpenAI's error types by status (its API's own: a 4xx is the request's fault, a 5xx the server's).
ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_exceeded",
               503: "server_error"}
MODEL_NOT_FOUND = "model_not_found"


class OpenAIErrorDetail(BaseModel):
    message: str = Field(min_length=1, description="what is wrong and what to change, as a sentence")
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": OpenAIErrorBody, "description": "Refused; `error.message` says what to change."},
    503: {"model": OpenAIErrorBody, "description": "Something it needs is being restarted; retry shortly."},
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, code))


def response_for(error: Exception) -> JSONResponse:
    """The answer to an error raised while serving an OpenAI-compatible route."""
    if isinstance(error, RequestValidationError):
        return error_response(400, validation_sentence(error.errors()))
    if isinstance(error, LiloError):
        # Errors raised inside a Ray actor arrive wrapped; the client gets the sentence.
        message = str(getattr(error, "cause", None) or error)
        if isinstance(error, InvalidRequestError):
            return error_response(400, message)
        status = status_for(error)
        return error_response(status, message, MODEL_NOT_FOUND if isinstance(error, NotFoundError) else None)
    if isinstance(error, StarletteHTTPException):  # a body over the size limit, found while it is read
        return error_response(error.status_code, str(error.detail))
    if isinstance(error, RayActorError):
        return error_response(503, "A lilo actor this request needed stopped while serving it and is being "
                                   "restarted; retry in a few seconds.")
    raise error


class OpenAIRoute(StrictJsonRoute):
    """A route whose JSON body is parsed strictly (``StrictJsonRoute``) and whose errors are answered in OpenAI's
    shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except (RequestValidationError, LiloError, RayActorError, StarletteHTTPException) as error:
                return response_for(error)

        return openai_handler


async def answer_openai(send: Send, status: int, message: str, code: str | None = None) -> None:
    """Answer a request from middleware (the API key gate) in OpenAI's shape."""
    body = json.dumps(error_body(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
