"""Strict JSON bodies and the error sentences, on a small app built like the ingress (no cluster needed): each body
that used to reach storage or the sampler and fail there (a 500) is a 422 with a sentence."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from serve.http.errors import install_error_handlers
from serve.http.json_body import MAX_DEPTH, StrictJsonRoute, parse_json


class Item(BaseModel):
    name: str
    count: int = 0


@pytest.fixture(scope="module")
def client() -> TestClient:
    api = FastAPI()
    api.router.route_class = StrictJsonRoute
    install_error_handlers(api)

    @api.post("/echo")
    def echo(body: Item) -> dict:
        return body.model_dump()

    @api.get("/only-get")
    def only_get() -> dict:
        return {}

    return TestClient(api)


def nested(depth: int) -> bytes:
    return b'{"name": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(("body", "reason"), [
    # Each of these was a 500 from create_session, get_info or optim_step before (orjson or SQLite refused it).
    (b'{"name": "\\ud800"}', "no low surrogate"),
    (b'{"name": "x", "count": NaN}', "NaN, Infinity and unpaired surrogates are not JSON"),
    (b'{"name": "x", "count": 1e400}', "infinity"),
    (nested(MAX_DEPTH + 1), f"nests deeper than {MAX_DEPTH} levels"),
    (b'{"name": "x", "count": 9223372036854775808}', "does not fit in 64 bits"),
    (b'{"name": "x"', "not valid JSON"),
])
def test_bodies_the_service_could_not_store_are_a_422_with_a_sentence(client, body, reason):
    response = client.post("/echo", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail.startswith("The request body is not valid JSON") and reason in detail, detail


def test_the_largest_64_bit_integers_and_moderate_nesting_pass():
    assert parse_json(b"[9223372036854775807, -9223372036854775808]") == [2**63 - 1, -2**63]
    assert parse_json(nested(MAX_DEPTH))["name"] == "x"


def test_a_validation_error_is_one_sentence_naming_each_field(client):
    # FastAPI's default was a list of error objects in `detail`, not a message.
    response = client.post("/echo", json={"count": "many"})
    assert response.status_code == 422
    assert response.json() == {"detail": "The request is not valid: body.name: Field required; body.count: Input "
                                         "should be a valid integer, unable to parse string as an integer. Fix "
                                         "these and send it again."}


def test_an_unknown_route_or_method_is_a_sentence_not_a_bare_phrase(client):
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and "There is no /nowhere here" in missing.json()["detail"]
    wrong = client.post("/only-get")
    assert wrong.status_code == 405 and wrong.json()["detail"] == "/only-get does not take POST; use GET."
