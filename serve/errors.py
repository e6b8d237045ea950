"""The one place where library errors become HTTP responses: a status per error type, the message as the body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lilo.errors import (
    ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, SaturatedError,
)

STATUS_BY_ERROR: dict[type[LiloError], int] = {
    InvalidRequestError: 422,
    NotFoundError: 404,
    GoneError: 410,
    ConflictError: 409,
    SaturatedError: 429,
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
