"""Two tenants on the session cluster (its keys file, conftest.py), over real HTTP and the tinker SDK: neither sees
nor touches the other's sessions, models, futures, checkpoints, sampling sessions or timing, and each refusal is
the very answer a thing that does not exist gets. Also: the 401s, and checkpoint names and paths that try to leave
the checkpoint directory."""

import dataclasses
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from conftest import TENANT_KEYS
from helpers import retrieve_finished, wait_for_heartbeat

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
# Ids of the same shapes as alpha's, of nothing at all.
NO_SESSION = "session-0000000000000000"
NO_MODEL = f"{NO_SESSION}:train:0"


@dataclasses.dataclass(frozen=True)
class Work:
    """What alpha made: a session, a model with a weights and a sampler checkpoint, a sampling session, a
    finished future."""

    session_id: str
    model_id: str
    weights: str
    sampler: str
    sampling_session_id: str
    request_id: str


def client(local_cluster, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=f"{local_cluster.api_url}/api/v1", timeout=60,
                        headers={"X-API-Key": TENANT_KEYS[tenant]})


def finished(http: httpx.Client, response: httpx.Response) -> httpx.Response:
    """The result of the future ``response`` returned."""
    assert response.status_code == 200, response.text
    return retrieve_finished(http, "/retrieve_future", response.json()["request_id"])


@pytest.fixture(scope="module")
def alpha(local_cluster):
    with client(local_cluster, "alpha") as http:
        yield http


@pytest.fixture(scope="module")
def beta(local_cluster):
    with client(local_cluster, "beta") as http:
        yield http


@pytest.fixture(scope="module")
def work(alpha) -> Work:
    session_id = alpha.post("/create_session", json={}).json()["session_id"]
    created = alpha.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                                "lora_config": {"rank": 4}})
    finished(alpha, created)
    model_id = created.json()["model_id"]
    step = alpha.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
    finished(alpha, step)
    weights = finished(alpha, alpha.post("/save_weights", json={"model_id": model_id, "seq_id": 2,
                                                                "path": "alpha-weights"})).json()["path"]
    sampler = finished(alpha, alpha.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 3,
                                                                            "path": "alpha-sampler"})).json()["path"]
    sampling = alpha.post("/create_sampling_session", json={"session_id": session_id, "sampling_session_seq_id": 0,
                                                            "model_path": sampler})
    assert sampling.status_code == 200, sampling.text
    return Work(session_id, model_id, weights, sampler, sampling.json()["sampling_session_id"],
                step.json()["request_id"])


def as_unknown(foreign: httpx.Response, unknown: httpx.Response, foreign_id: str, unknown_id: str) -> bool:
    """Whether another tenant's thing got the answer of a thing that does not exist, byte for byte (but its id)."""
    return (foreign.status_code == unknown.status_code == 404
            and foreign.headers["content-type"] == unknown.headers["content-type"]
            and foreign.content == unknown.content.replace(unknown_id.encode(), foreign_id.encode()))


def test_a_heartbeat_is_answered_by_the_api_yet_checked_and_written_like_the_session(work, alpha, beta, local_cluster):
    heartbeat = {"session_id": work.session_id}
    before = time.time()
    assert alpha.post("/session_heartbeat", json=heartbeat).status_code == 200  # the replica now knows the session
    assert alpha.post("/session_heartbeat", json=heartbeat).status_code == 200
    # Known to the replica as alpha's, it still answers beta exactly as a session that does not exist.
    assert as_unknown(beta.post("/session_heartbeat", json=heartbeat),
                      beta.post("/session_heartbeat", json={"session_id": NO_SESSION}), work.session_id, NO_SESSION)
    # The time reaches the futures DB's file: handed over within a second, written within its maintenance round.
    wait_for_heartbeat(local_cluster.home / "futures.db", work.session_id, since=before)


def test_another_tenants_session_and_model_answer_as_unknown_ones(work, beta):
    def both(path: str, body: dict, key: str, unknown_id: str) -> tuple[httpx.Response, httpx.Response]:
        return (beta.post(path, json=body),
                beta.post(path, json={**body, key: body[key].replace(getattr(work, key), unknown_id)}))

    for path, body in (("/session_heartbeat", {"session_id": work.session_id}),
                       ("/create_model", {"session_id": work.session_id, "model_seq_id": 1, "base_model": TINY,
                                          "lora_config": {"rank": 4}}),
                       ("/load_weights", {"session_id": work.session_id, "model_seq_id": 1, "path": work.weights}),
                       ("/create_sampling_session", {"session_id": work.session_id, "sampling_session_seq_id": 5,
                                                     "base_model": TINY})):
        assert as_unknown(*both(path, body, "session_id", NO_SESSION), work.session_id, NO_SESSION), path
    proto = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum()], loss_fn="cross_entropy"),
        model_id=work.model_id, seq_id=4))
    protobuf = {"Content-Type": "application/x-protobuf"}
    foreign_fb = beta.post("/forward_backward", content=proto.SerializeToString(), headers=protobuf)
    proto.model_id = NO_MODEL
    unknown_fb = beta.post("/forward_backward", content=proto.SerializeToString(), headers=protobuf)
    assert as_unknown(foreign_fb, unknown_fb, work.model_id, NO_MODEL)
    for path, body in (("/get_info", {"model_id": work.model_id}),
                       ("/optim_step", {"model_id": work.model_id, "seq_id": 4, "adam_params": {}}),
                       ("/save_weights", {"model_id": work.model_id, "seq_id": 4, "path": "stolen"}),
                       ("/save_weights_for_sampler", {"model_id": work.model_id, "seq_id": 4, "path": "stolen"}),
                       ("/save_weights_for_sampler", {"model_id": work.model_id, "seq_id": 4,
                                                      "sampling_session_seq_id": 7}),
                       ("/unload_model", {"model_id": work.model_id})):
        assert as_unknown(*both(path, body, "model_id", NO_MODEL), work.model_id, NO_MODEL), path


def test_finishing_another_tenants_session_unloads_nothing_of_it(work, alpha, beta):
    assert beta.post(f"/sessions/{work.session_id}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert alpha.post("/get_info", json={"model_id": work.model_id}).status_code == 200


def test_another_tenants_future_answers_as_one_that_is_gone(work, alpha, beta):
    assert "metrics" in alpha.post("/retrieve_future", json={"request_id": work.request_id}).json()
    foreign = beta.post("/retrieve_future", json={"request_id": work.request_id})
    # The answer of a request id with no row (below the highest id: pruned), which reveals nothing of alpha's.
    assert foreign.status_code == 410
    assert foreign.json() == {"detail": f"Request {work.request_id} finished more than 24 h ago and its result was "
                                        "pruned, or it was sent with another API key; results are kept for the "
                                        "retention time only."}


def test_another_tenants_checkpoints_cannot_be_loaded_sampled_listed_or_deleted(work, alpha, beta, local_cluster):
    session_id = beta.post("/create_session", json={}).json()["session_id"]
    created = beta.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                               "lora_config": {"rank": 4}})
    finished(beta, created)
    unknown_weights = work.weights.replace(work.model_id, NO_MODEL)
    unknown_sampler = work.sampler.replace(work.model_id, NO_MODEL)
    for body in ({"model_id": created.json()["model_id"], "seq_id": 1, "path": work.weights},
                 {"session_id": session_id, "model_seq_id": 1, "path": work.weights}):
        pair = [beta.post("/load_weights", json={**body, "path": path}) for path in (work.weights, unknown_weights)]
        assert as_unknown(*pair, work.model_id, NO_MODEL), body
    sampling = {"session_id": session_id, "sampling_session_seq_id": 0}
    pair = [beta.post("/create_sampling_session", json={**sampling, "model_path": path})
            for path in (work.sampler, unknown_sampler)]
    assert as_unknown(*pair, work.model_id, NO_MODEL)

    runs = beta.get("/training_runs").json()["training_runs"]
    # Only beta's own runs (other tests give beta runs too), never alpha's.
    assert created.json()["model_id"] in [run["training_run_id"] for run in runs]
    assert {run["model_owner"] for run in runs} == {"beta"}
    assert work.model_id not in beta.get("/checkpoints").text
    for suffix in ("", "/checkpoints"):
        pair = [beta.get(f"/training_runs/{run}{suffix}") for run in (work.model_id, NO_MODEL)]
        assert as_unknown(*pair, work.model_id, NO_MODEL), suffix
    pair = [beta.delete(f"/training_runs/{run}/checkpoints/weights/alpha-weights") for run in (work.model_id, NO_MODEL)]
    assert as_unknown(*pair, work.model_id, NO_MODEL)
    assert work.weights in alpha.get(f"/training_runs/{work.model_id}/checkpoints").text
    # The SDK's RestClient gets the 404 as its NotFoundError.
    rest = tinker.RestClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS["beta"])
    with pytest.raises(tinker.NotFoundError, match="Unknown training run"):
        rest.get_training_run(work.model_id).result(timeout=TIMEOUT_S)


def test_another_tenants_sampling_session_answers_as_an_unknown_one(work, alpha, beta):
    unknown = f"{NO_SESSION}:sample:0"
    sample = {"seq_id": 0, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
              "sampling_params": {"max_tokens": 2, "seed": 1}}
    assert alpha.get(f"/samplers/{work.sampling_session_id}").status_code == 200
    pair = [beta.get(f"/samplers/{sampling_id}") for sampling_id in (work.sampling_session_id, unknown)]
    assert as_unknown(*pair, work.sampling_session_id, unknown)
    # Asked before alpha's first sample (its route unknown to the replica) and after (the route cached there).
    for _ in range(2):
        pair = [beta.post("/asample", json={**sample, "sampling_session_id": sampling_id})
                for sampling_id in (work.sampling_session_id, unknown)]
        assert as_unknown(*pair, work.sampling_session_id, unknown)
        # Even a request that is wrong for the session is refused as for an unknown one, not judged.
        pair = [beta.post("/asample", json={**sample, "sampling_session_id": sampling_id,
                                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [10 ** 7]}]}})
                for sampling_id in (work.sampling_session_id, unknown)]
        assert as_unknown(*pair, work.sampling_session_id, unknown)
        finished(alpha, alpha.post("/asample", json={**sample, "sampling_session_id": work.sampling_session_id}))
        sample["seq_id"] += 1


def test_timing_of_another_tenants_model_is_a_404_and_the_cluster_view_names_no_model(work, alpha, beta):
    assert alpha.get("/timing", params={"model_id": work.model_id}).status_code == 200
    for foreign, unknown in ((work.model_id, NO_MODEL), (work.sampler, work.sampler.replace(work.model_id, NO_MODEL)),
                             (work.sampling_session_id, f"{NO_SESSION}:sample:0")):
        pair = [beta.get("/timing", params={"model_id": model_id}) for model_id in (foreign, unknown)]
        assert as_unknown(*pair, foreign, unknown), foreign
    cluster = beta.get("/timing")
    assert cluster.status_code == 200 and cluster.json()["model_id"] == "*"
    assert work.model_id not in cluster.text and work.session_id not in cluster.text


def test_requests_without_a_valid_key_are_401s_that_say_what_to_set(local_cluster):
    api = f"{local_cluster.api_url}/api/v1"
    for headers, message in (({}, "send one in the X-API-Key header"),
                             ({"X-API-Key": "sk-local-test"}, "API keys start with 'tml-'"),
                             ({"X-API-Key": "tml-nobody-configured-this"}, "Unknown API key")):
        for refused in (httpx.post(f"{api}/create_session", json={}, headers=headers),
                        httpx.get(f"{api}/training_runs", headers=headers),
                        httpx.post(f"{api}/retrieve_future", content=b"not even json", headers=headers)):
            assert refused.status_code == 401 and message in refused.json()["detail"], refused.text
    assert httpx.get(f"{api}/healthz").status_code == 200
    assert httpx.post(f"{api}/client/config", json={}).status_code == 200
    assert httpx.get(f"{api}/get_server_capabilities").status_code == 200
    with pytest.raises(tinker.AuthenticationError):
        with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-nobody-configured-this") as service:
            service.create_lora_training_client(base_model=TINY, rank=4)


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b", "..", "%2E%2E%2Fescape", "..%2Fescape", ".x"])
def test_a_checkpoint_name_that_could_leave_the_directory_is_refused_at_once(work, alpha, local_cluster, name):
    for path in ("/save_weights", "/save_weights_for_sampler"):
        refused = alpha.post(path, json={"model_id": work.model_id, "seq_id": 50, "path": name})
        assert refused.status_code == 422 and "is not allowed" in refused.json()["detail"], refused.text
    assert not list((local_cluster.home / "checkpoints").rglob("*escape*"))
    assert not (local_cluster.home / "escape").exists() and not (local_cluster.home / "etc").exists()


@pytest.mark.parametrize("path", ["tinker://../weights/x", "tinker://run/weights/../../x", "file:///etc/passwd",
                                  "/etc/passwd", "tinker://run/weights/%2E%2E%2Fx", "tinker://run/../weights/x"])
def test_a_checkpoint_path_that_could_leave_the_directory_is_refused(work, alpha, path):
    for route, body in (("/load_weights", {"model_id": work.model_id, "seq_id": 50, "path": path}),
                        ("/load_weights", {"session_id": work.session_id, "model_seq_id": 9, "path": path}),
                        ("/create_sampling_session", {"session_id": work.session_id, "sampling_session_seq_id": 9,
                                                      "model_path": path})):
        refused = alpha.post(route, json=body)
        assert refused.status_code == 422 and "heckpoint" in refused.json()["detail"], (route, refused.text)


def test_encoded_run_ids_in_urls_find_nothing(work, alpha):
    for run in ("..%2F..%2Fetc", "%2E%2E", "%2E%2E%2F%2E%2E", work.model_id + "%2F..%2F.."):
        response = alpha.get(f"/training_runs/{run}/checkpoints")
        assert response.status_code == 404, (run, response.text)


def datum() -> types.Datum:
    tokens = np.random.default_rng(3).integers(3, 1000, 9).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8})
