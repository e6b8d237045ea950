"""retrieve_future over real HTTP, answered by the cluster's futures DB actor; bad ids get a 4xx that says why."""

import threading
import uuid

import httpx
import orjson
import pytest
import ray

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from helpers import AUTH
from lilo.futures.store import Completion, Submission


@pytest.fixture
def futures(ray_driver):
    return ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)


def retrieve(local_cluster, request_id, **extra) -> httpx.Response:
    return httpx.post(f"{local_cluster.api_url}/api/v1/retrieve_future",
                      json={"request_id": request_id, "allow_metadata_only": True, **extra}, headers=AUTH, timeout=60)


def submitted(futures) -> int:
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    return ray.get(futures.submit.remote(Submission(model_id, "optim_step", {"lr": 1e-4}, seq_id=0)))


def test_a_completed_future_returns_its_result(local_cluster, futures):
    request_id = submitted(futures)
    ray.get(futures.complete.remote([Completion.success(request_id, orjson.dumps({"metrics": {"loss": 1.5}}))]))
    response = retrieve(local_cluster, str(request_id))
    assert response.status_code == 200
    assert response.json() == {"metrics": {"loss": 1.5}}


def test_a_failed_future_returns_error_and_category(local_cluster, futures):
    request_id = submitted(futures)
    ray.get(futures.complete.remote([Completion.failure(request_id, "the trainer ran out of memory", "server")]))
    assert retrieve(local_cluster, str(request_id)).json() == {
        "error": "the trainer ran out of memory", "category": "server"}


def test_a_parked_retrieve_answers_as_soon_as_the_result_lands(local_cluster, futures):
    request_id = submitted(futures)
    threading.Timer(0.5, lambda: ray.get(futures.complete.remote(
        [Completion.success(request_id, b'{"ok": true}')]))).start()
    response = retrieve(local_cluster, str(request_id))
    assert response.json() == {"ok": True}
    assert response.elapsed.total_seconds() < 10


@pytest.mark.parametrize(("request_id", "status", "message"), [
    ("987654321", 404, "Unknown request_id 987654321"),
    ("not-an-id", 422, "is not a request id"),
    ("-3", 422, "ids are positive integers"),
    # Found by fuzzing: past SQLite's 64-bit range it failed the waiter's shared query every tick, so it and every
    # other parked retrieve_future hung for the whole 40 s long poll.
    (str(2**63), 422, "ids are positive integers up to 9223372036854775807"),
])
def test_bad_ids_are_4xx_with_a_message(local_cluster, request_id, status, message):
    response = retrieve(local_cluster, request_id)
    assert response.status_code == status
    assert message in response.json()["detail"]


def test_a_malformed_body_is_a_422(local_cluster):
    response = httpx.post(f"{local_cluster.api_url}/api/v1/retrieve_future", json={"allow_metadata_only": True},
                          headers=AUTH)
    assert response.status_code == 422
