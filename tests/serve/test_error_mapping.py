"""The one error -> HTTP table: each library error becomes its status with its sentence as the body."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lilo.errors import (
    ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, SaturatedError, TooLargeError,
    UnavailableError, failure_category,
)
from serve.http.errors import install_error_handlers


@pytest.mark.parametrize(("error", "status"), [
    (InvalidRequestError("request_id 'x' is not a request id; pass the id a submission returned."), 422),
    (NotFoundError("Unknown request_id 9; pass an id that a submission returned."), 404),
    (GoneError("Request 3 finished more than 24 h ago and its result was pruned."), 410),
    (ConflictError("seq_id 4 of model 'm' was already submitted (request 7) with a different payload."), 409),
    (SaturatedError("Every trainer is full; retry later."), 429),
    (TooLargeError("The zstd body inflates past this server's limit of 1048576 bytes; send a smaller batch."), 413),
    (LiloError("Something else the client can fix."), 400),
])
def test_each_error_maps_to_its_status_with_its_message(error, status):
    api = FastAPI()
    install_error_handlers(api)

    @api.get("/boom")
    def boom():
        raise error

    response = TestClient(api).get("/boom")
    assert response.status_code == status
    assert response.json() == {"detail": str(error)}


@pytest.mark.parametrize(("error", "category"), [
    (InvalidRequestError("Token id 5000 is outside the vocabulary of 1000; send ids below 1000."), "user"),
    (NotFoundError("Unknown model_id 'm'; create the model first."), "user"),
    (UnavailableError("Model 'm' is being restored on another trainer; retry in a few seconds."), "server"),
    (RuntimeError("CUDA out of memory"), "server"),
])
def test_a_failed_future_blames_the_client_only_for_what_the_client_can_fix(error, category):
    assert failure_category(error) == category
