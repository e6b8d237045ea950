"""Typed errors the library raises; only the HTTP ingress turns them into responses (serve maps them to 4xx).

Every message is a sentence that says what is wrong and what to change.
"""


class LiloError(Exception):
    """Base of the errors a client can act on."""


class InvalidRequestError(LiloError):
    """The request is malformed (HTTP 422)."""


class NotFoundError(LiloError):
    """No such thing, or not yours (HTTP 404)."""


class ForbiddenError(LiloError):
    """A credential that is not good for this request, such as a download link lilo did not sign or that expired
    (HTTP 403)."""


class GoneError(LiloError):
    """It existed but is gone: a result pruned after the retention time, an unloaded model, an expired checkpoint or
    recorded sequence (HTTP 410)."""


class ConflictError(LiloError):
    """It clashes with something already accepted, such as another payload under the same seq id (HTTP 409)."""


class SaturatedError(LiloError):
    """The service is full right now; retry later (HTTP 429)."""


class RateLimitedError(SaturatedError):
    """A tenant over one of its rate limits (the tenants file): HTTP 429 with ``Retry-After``, which the SDK waits
    out before it sends the same request again."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses Ray (pickled) with its wait
        return type(self), (str(self), self.retry_after_s)


class QuotaExceededError(LiloError):
    """A tenant at one of its limits on amounts (models, rank, base models, storage): HTTP 403, which the SDK does not
    retry; the message names the limit, its value and what is in use."""


class UnavailableError(LiloError):
    """Something it needs is being restored (a trainer's models after the trainer failed); retry shortly (HTTP
    503, which the SDK retries by itself)."""


class CancelledByClientError(LiloError):
    """A sample its client abandoned and cancelled (``cancel_future``): its future fails with this, the client has
    stopped waiting for it."""

    @classmethod
    def of_sample(cls, request_id: str) -> "CancelledByClientError":
        return cls(f"Sample {request_id} was cancelled by its client (cancel_future).")


class TooLargeError(LiloError):
    """The request is larger than this server takes, as sent or once inflated (HTTP 413)."""


def failure_category(error: BaseException) -> str:
    """The category a failed future reports: ``user`` when the client can fix the request, ``server`` when the
    service failed it (an internal error, or something being restored)."""
    return "user" if isinstance(error, LiloError) and not isinstance(error, UnavailableError) else "server"
