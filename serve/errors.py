"""The one place where library errors become HTTP responses: a status per error type, the message as the body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError

from lilo.errors import (
    ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, SaturatedError, UnavailableError,
)

STATUS_BY_ERROR: dict[type[LiloError], int] = {
    InvalidRequestError: 422,
    NotFoundError: 404,
    GoneError: 410,
    ConflictError: 409,
    SaturatedError: 429,
    UnavailableError: 503,
}


def status_for(error: LiloError) -> int:
    for kind, status in STATUS_BY_ERROR.items():
        if isinstance(error, kind):
            return status
    return 400


def install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(LiloError)
    async def lilo_error(_request: Request, error: LiloError) -> JSONResponse:
        # Errors raised inside a Ray actor arrive wrapped; the client gets the sentence, not the traceback.
        message = str(getattr(error, "cause", None) or error)
        return JSONResponse(status_code=status_for(error), content={"detail": message})

    @api.exception_handler(RayActorError)
    async def actor_gone(_request: Request, error: RayActorError) -> JSONResponse:
        # A trainer or the futures DB died under the request; Ray is restarting it. The SDK retries a 503 by
        # itself, and a retried submission with the same seq_id finds what was recorded, never runs twice.
        return JSONResponse(status_code=503, content={
            "detail": "A lilo actor this request needed stopped while serving it and is being restarted; retry in "
                      "a few seconds."})
