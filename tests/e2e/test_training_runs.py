"""Training runs and checkpoints (the SDK's RestClient), create-via-load (``create_training_client_from_state``)
and ``unload_model``, against the local cluster with the official tinker SDK (0.38.0) where it has the call, raw
HTTP where it does not."""

import uuid

import httpx
import numpy as np
import pytest
import ray
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from helpers import AUTH, retrieve_finished
from lilo.backend.checkpoints.paths import local_directory

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture
def api(local_cluster):
    with httpx.Client(base_url=f"{local_cluster.api_url}/api/v1", timeout=60, headers=AUTH) as client:
        yield client


def datum() -> types.Datum:
    tokens = np.random.default_rng(5).integers(3, 1000, 20).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 19})


def step(training) -> None:
    training.forward_backward([datum()], "cross_entropy").result(timeout=TIMEOUT_S)
    training.optim_step(ADAM).result(timeout=TIMEOUT_S)


def loss(training) -> float:
    return training.forward([datum()], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"]


@ray.remote(num_cpus=0)
class ShortLivedKeeper:
    """Stands in for a trainer that keeps a run's files and then dies."""

    def list_checkpoints(self, runs: list[str]) -> dict:
        return {run: [] for run in runs}


def retrieve(api: httpx.Client, request_id: str) -> dict:
    """A future's JSON result (or its error)."""
    return retrieve_finished(api, "/retrieve_future", request_id).json()


def test_a_training_client_from_state_resumes_the_saved_adapter_with_or_without_its_optimizer(service):
    original = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    step(original)
    step(original)
    at_save = loss(original)
    path = original.save_state("resume-me").result(timeout=TIMEOUT_S).path
    step(original)  # one step on from the checkpoint
    one_step_on = loss(original)

    resumed = service.create_training_client_from_state_with_optimizer(path).result(timeout=TIMEOUT_S)
    fresh_optimizer = service.create_training_client_from_state(path).result(timeout=TIMEOUT_S)
    assert resumed.model_id != original.model_id and resumed.model_id.endswith(f":train:{resumed._training_client_id}")
    assert resumed.get_info().lora_rank == 4 and resumed.get_info().model_data.model_name == TINY
    assert loss(resumed) == pytest.approx(at_save, rel=1e-6)
    assert loss(fresh_optimizer) == pytest.approx(at_save, rel=1e-6)

    # One step from the checkpoint: with its Adam moments it is the step the original took; without them, another.
    step(resumed)
    step(fresh_optimizer)
    assert loss(resumed) == pytest.approx(one_step_on, rel=1e-6)
    assert loss(fresh_optimizer) != pytest.approx(one_step_on, rel=1e-6)


def test_create_via_load_retried_is_one_model_and_bad_paths_are_refused_with_a_message(service, api):
    original = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    path = original.save_state("for-retries").result(timeout=TIMEOUT_S).path
    session_id = api.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "path": path, "optimizer": True}
    runs_before = api.get("/training_runs").json()["cursor"]["total_count"]
    first, retry = api.post("/load_weights", json=body).json(), api.post("/load_weights", json=body).json()
    assert first == retry and first["model_id"] == f"{session_id}:train:0"
    assert retrieve(api, first["request_id"]) == {"path": path}
    assert api.get("/training_runs").json()["cursor"]["total_count"] == runs_before + 1

    other = api.post("/load_weights", json={**body, "path": path.replace("for-retries", "other")})
    assert other.status_code == 409 and "seq_id 0" in other.json()["detail"]
    refusals = [
        ({**body, "model_seq_id": 1, "path": path.replace("for-retries", "never-saved")}, 404,
         "No training checkpoint"),
        ({**body, "model_seq_id": 1, "path": "tinker://no-such-run/weights/x"}, 404, "No training run"),
        ({**body, "model_seq_id": 1, "path": path.replace("/weights/", "/sampler_weights/")}, 422,
         "not a training checkpoint"),
        ({**body, "model_seq_id": 1, "base_model": "other/model"}, 422, "leave base_model out"),
        # Resuming the optimizer state resumes its family; another is refused, as is a family lilo does not know.
        ({**body, "model_seq_id": 1, "optimizer_config": {"type": "dimuon"}}, 422,
         "was trained with adamw, not dimuon"),
        ({**body, "model_seq_id": 1, "optimizer_config": {"type": "lion"}}, 422, "Unknown optimizer 'lion'"),
        ({"session_id": session_id, "path": path, "optimizer": True}, 422, "either model_id and seq_id"),
    ]
    for request, status, message in refusals:
        response = api.post("/load_weights", json=request)
        assert (response.status_code, message in response.json()["detail"]) == (status, True), response.text
    assert api.post("/get_info", json={"model_id": f"{session_id}:train:1"}).status_code == 404  # nothing created


def test_the_rest_client_lists_runs_and_checkpoints_and_deletes_one(service, local_cluster, api, ray_driver):
    training = service.create_lora_training_client(base_model=TINY, rank=8).result(timeout=TIMEOUT_S)
    step(training)
    weights = training.save_state("listed").result(timeout=TIMEOUT_S).path
    sampler = training.save_weights_for_sampler("listed-sampler").result(timeout=TIMEOUT_S).path
    rest = tinker.RestClient(base_url=local_cluster.api_url, api_key="tml-local-test")

    run = rest.get_training_run(training.model_id).result(timeout=TIMEOUT_S)
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (training.model_id, TINY, 8, True)
    assert run.last_checkpoint.tinker_path == weights and run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(weights).result(timeout=TIMEOUT_S).training_run_id == training.model_id
    # Runs whose trainer is gone (it died, or a cluster restarted with fewer trainers) are still listed.
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    keeper_name = f"lilo-trainer-short-lived-{uuid.uuid4().hex[:8]}"
    keeper = ShortLivedKeeper.options(name=keeper_name, namespace=NAMESPACE).remote()
    orphans = {f"orphan-{uuid.uuid4().hex[:8]}": trainer for trainer in ("lilo-trainer-never-was", keeper_name)}
    for orphan, trainer in orphans.items():
        ray.get(futures.add_model.remote(orphan, TINY, {"rank": 2}, trainer=trainer))
    rest.list_training_runs(limit=100).result(timeout=TIMEOUT_S)  # the ingress now holds a handle to the keeper
    ray.kill(keeper)
    listed = rest.list_training_runs(limit=100).result(timeout=TIMEOUT_S)
    assert {training.model_id, *orphans} <= {r.training_run_id for r in listed.training_runs}
    assert all(rest.list_checkpoints(orphan).result(timeout=TIMEOUT_S).checkpoints == [] for orphan in orphans)
    assert listed.cursor.total_count >= len(listed.training_runs) and listed.cursor.limit == 100
    newest = rest.list_training_runs(limit=1).result(timeout=TIMEOUT_S)
    assert len(newest.training_runs) == 1 and newest.cursor.total_count == listed.cursor.total_count

    checkpoints = rest.list_checkpoints(training.model_id).result(timeout=TIMEOUT_S).checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in checkpoints} == {
        ("weights/listed", "training", weights), ("sampler_weights/listed-sampler", "sampler", sampler)}
    assert all(c.size_bytes > 0 and c.time.tzinfo is not None for c in checkpoints)
    everyone = rest.list_user_checkpoints(limit=1000).result(timeout=TIMEOUT_S).checkpoints
    assert {weights, sampler} <= {c.tinker_path for c in everyone}

    on_disk = local_directory(local_cluster.home / "checkpoints", weights)
    assert on_disk.is_dir()
    rest.delete_checkpoint_from_tinker_path(weights).result(timeout=TIMEOUT_S)
    assert not on_disk.exists()
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result(timeout=TIMEOUT_S).checkpoints] \
        == [sampler]
    assert rest.get_training_run(training.model_id).result(timeout=TIMEOUT_S).last_checkpoint is None
    with pytest.raises(tinker.NotFoundError, match="has no checkpoint 'weights/listed'"):
        rest.delete_checkpoint(training.model_id, "weights/listed").result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.NotFoundError, match="Unknown training run"):
        rest.get_training_run("no-such-run").result(timeout=TIMEOUT_S)

    run_url = f"/training_runs/{training.model_id}/checkpoints"
    for escape in ("weights/..%2F..%2F..%2Fx", "weights/%2E%2E", "sampler_weights", "elsewhere/x"):
        response = api.delete(f"{run_url}/{escape}")
        assert response.status_code == 422 and "heckpoint" in response.json()["detail"], (escape, response.text)
    assert api.get("/training_runs/no-such-run/checkpoints").status_code == 404
    assert api.get("/training_runs", params={"limit": 0}).status_code == 422


def test_unload_runs_what_was_queued_then_frees_the_slot_and_later_requests_are_gone(service, local_cluster, api,
                                                                                       ray_driver):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    model_id = training.model_id
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    trainer = ray.get_actor(ray.get(futures.trainer_of.remote(model_id)), namespace=NAMESPACE)
    free_before = ray.get(trainer.ready.remote())["free_slots"]
    # Recorded and handed to the trainer before the unload (each answer comes once it was).
    queued = [api.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}}).json(),
              api.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "before-unload"}).json()]

    unload = api.post("/unload_model", json={"model_id": model_id}).json()
    assert api.post("/unload_model", json={"model_id": model_id}).json() == unload  # a retry: the same future
    assert retrieve(api, unload["request_id"]) == {"model_id": model_id, "type": "unload_model"}
    saved = retrieve(api, queued[1]["request_id"])["path"]
    assert "error" not in retrieve(api, queued[0]["request_id"])
    assert ray.get(trainer.ready.remote())["free_slots"] == free_before + 1

    later = api.post("/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": {}})
    assert later.status_code == 410 and "was unloaded" in later.json()["detail"]
    assert api.post("/get_info", json={"model_id": model_id}).status_code == 410
    # The run and its checkpoints stay: a new model can start from them.
    rest = tinker.RestClient(base_url=local_cluster.api_url, api_key="tml-local-test")
    assert saved in [c.tinker_path for c in rest.list_checkpoints(model_id).result(timeout=TIMEOUT_S).checkpoints]
    restarted = service.create_training_client_from_state(saved, user_metadata={"from": "before-unload"})
    restarted = restarted.result(timeout=TIMEOUT_S)
    assert loss(restarted) > 0
    run = rest.get_training_run(restarted.model_id).result(timeout=TIMEOUT_S)
    assert run.user_metadata == {"from": "before-unload"}
    missing = api.post("/unload_model", json={"model_id": "no-such-model"})
    assert missing.status_code == 404 and "Unknown model_id" in missing.json()["detail"]
