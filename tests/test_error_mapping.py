"""The one error -> HTTP table: each library error becomes its status with its sentence as the body."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lilo.errors import ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, SaturatedError
from serve.errors import install_error_handlers


@pytest.mark.parametrize(("error", "status"), [
    (InvalidRequestError("request_id 'x' is not a request id; pass the id a submission returned."), 422),
    (NotFoundError("Unknown request_id 9; pass an id that a submission returned."), 404),
    (GoneError("Request 3 finished more than 24 h ago and its result was pruned."), 410),
    (ConflictError("seq_id 4 of model 'm' was already submitted (request 7) with a different payload."), 409),
    (SaturatedError("Every trainer is full; retry later."), 429),
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
