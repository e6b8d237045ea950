"""The SDK (0.38.0) with the server feature flags lilo turns on: a sampling client polls its session's completions
(retrieve_futures) instead of one long poll per sample, an abandoned sample is cancelled (cancel_future), an unpickled
sampling client joins its session for a clone id of its own, a custom loss runs on the server in one pass beside other
clients' steps, and forward_backward bodies arrive zstd-compressed (the session cluster asks it of every client)."""

import concurrent.futures
import contextlib
import pickle
import sqlite3
import time

import numpy as np
import torch

import httpx
import ray
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from helpers import API_KEY, eventually, on_one_trainer, sdk_datum, unload_models
from lilo.timing import critical_path_metrics

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
IN_FLIGHT = 24


def futures_stats() -> dict:
    return ray.get(ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE).stats.remote())


def samples(sampler: tinker.SamplingClient, count: int, seed: int = 0) -> list[types.SampleResponse]:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
    pending = [sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7 + k]), num_samples=1,
                              sampling_params=params) for k in range(count)]
    return [future.result(timeout=TIMEOUT_S) for future in pending]


def test_client_config_turns_on_the_flags_lilo_implements(local_cluster, service):
    answered = httpx.post(f"{local_cluster.api_url}/api/v1/client/config", json={}).json()
    # Compressed bodies: the session cluster runs --compress-bodies always.
    assert answered == {"pjwt_auth_enabled": True, "sample_use_retrieve_futures": True,
                        "sample_join_sampling_session": True, "custom_loss_server_side": True,
                        "proto_compress_fwdbwd": True}
    config = service.holder.get_client_config()
    assert config.sample_use_retrieve_futures and config.sample_join_sampling_session and config.proto_compress_fwdbwd
    assert config.custom_loss_server_side


def test_a_sampling_client_polls_its_session_not_each_sample(service, ray_driver):
    sampler = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    before = futures_stats()
    responses = samples(sampler, IN_FLIGHT)
    after = futures_stats()
    assert all(len(response.sequences[0].tokens) == 4 for response in responses)
    polls = after["session_polls"] - before["session_polls"]
    queries = after["session_poll_queries"] - before["session_poll_queries"]
    # The SDK polled retrieve_futures (its per-sample retrieve_future then fetches results the poll said are there),
    # and each poll cost the ledger at most one statement, however many samples it answered.
    assert 1 <= polls <= IN_FLIGHT + 1 and queries <= polls, (polls, queries)


def test_an_unpickled_sampling_client_joins_for_a_clone_id_of_its_own(service):
    sampler = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    samples(sampler, 2)
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answered = list(pool.map(lambda clone: samples(clone, 3, seed=7), clones))
    # Each asked the server for its clone id, so their requests' seq ids never collide with each other's or the
    # original's: every sample ran (a collision would be a 409 for the second of two different prompts).
    assert sorted(clone._cloned_sampler_id for clone in clones) == [1, 2]
    assert all(len(response.sequences[0].tokens) == 4 for responses in answered for response in responses)


def test_forward_backward_bodies_arrive_zstd_compressed(service):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    assert training.holder.get_client_config().proto_compress_fwdbwd
    output = training.forward_backward([sdk_datum(seed) for seed in range(4)], "cross_entropy").result(TIMEOUT_S)
    assert len(output.loss_fn_outputs) == 4 and output.metrics["loss:sum"] > 0


def session_samples(db_path, sampling_session_id: str) -> list[tuple[str, str | None]]:
    """(status, error) of each of the session's samples, read-only from the ledger's file."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as connection:
        return connection.execute("SELECT status, error FROM futures WHERE model_id = ? ORDER BY request_id",
                                  (sampling_session_id,)).fetchall()


def test_an_abandoned_sample_is_cancelled_and_its_generation_stops(local_cluster, service):
    sampler = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    assert service.holder._client_dynamic_config.sample_cancel_enabled
    # As long as the tiny model's context allows, many times over: seconds of generation.
    long = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=32,
                          sampling_params=types.SamplingParams(max_tokens=509, temperature=1.0))
    session = sampler._sampling_session_id
    db = local_cluster.settings.futures_db
    eventually(lambda: session_samples(db, session), "the long sample was recorded", every_s=0.05)
    long.future().cancel()  # the client abandons it: the SDK sends cancel_future
    status, error = eventually(lambda: next((row for row in session_samples(db, session) if row[0] != "pending"),
                                            None), "the abandoned sample failed", timeout_s=60)
    assert status == "failed" and "cancelled by its client" in error
    # Its trainer is free again: the next sample of the session runs.
    assert len(samples(sampler, 1)[0].sequences[0].tokens) == 4


def clipped_ratio_loss(logprobs, sampler_logprobs, advantages):
    ratio = torch.exp(logprobs - sampler_logprobs)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


def rl_datum(seed: int, length: int = 24) -> types.Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, length + 1).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "sampler_logprobs": rng.normal(-7, 0.3, length).astype(np.float32),
        "advantages": rng.normal(0, 1, length).astype(np.float32)})


def test_a_server_side_custom_loss_runs_in_one_pass_beside_another_clients_cross_entropy(
        service, local_cluster, ray_driver):
    handle = service.create_custom_loss(
        clipped_ratio_loss, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}).result(timeout=TIMEOUT_S)
    assert handle.loss_id is not None  # uploaded: the SDK sends forward_backward(data, "custom", {loss_id})
    created = [service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
               for _ in range(5)]
    try:
        blocker, custom, plain = on_one_trainer(created, 3)
        # A long forward (seconds here) keeps the trainer busy while both steps queue behind it: its next pass
        # takes them together. Sent first, and given a moment to start: each client sends on its own.
        busy = blocker.forward([sdk_datum(seed, length=400) for seed in range(24)], "cross_entropy")
        time.sleep(0.5)
        stepped = custom.forward_backward_custom([rl_datum(1), rl_datum(2)], handle)
        crossed = plain.forward_backward([sdk_datum(3)], "cross_entropy")
        busy.result(timeout=TIMEOUT_S)
        output, _ = stepped.result(timeout=TIMEOUT_S), crossed.result(timeout=TIMEOUT_S)
        timing = critical_path_metrics(custom.model_id, base_url=local_cluster.api_url, api_key=API_KEY)
    finally:
        unload_models(local_cluster.api_url, [client.model_id for client in created])
    assert output.metrics["loss:sum"] != 0 and 0 < output.metrics["custom/ratio:mean"]
    assert "surrogate_loss:sum" not in output.metrics  # no client-side forward and linearized backward
    assert timing["lilo/forward_backward.execute.count"] == 1  # one request, one pass...
    assert timing["lilo/forward_backward.execute.mean_batch"] == 2  # ...shared with the cross_entropy step


def test_a_custom_loss_that_calls_outside_torch_is_refused_naming_the_node(local_cluster, service):
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
             {"op": "call_function", "name": "escape", "target": "os.system", "args": ["id"]},
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "logprobs"}, {"dict": {}}]}]}]
    answer = httpx.post(f"{local_cluster.api_url}/api/v1/create_custom_loss", headers={"X-API-Key": API_KEY}, json={
        "session_id": service.holder.get_session_id(), "custom_loss_seq_id": 99, "name": "evil",
        "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes}})
    assert answer.status_code == 422 and "'escape' calls 'os.system'" in answer.json()["detail"]


def test_a_training_clients_results_are_pushed_to_the_ingress_not_fetched_per_retrieve(service, ray_driver):
    # Each result is pushed to the replica that submitted it (serve.tinker.pushed_results), which answers the
    # client's retrieve_future itself: the futures DB sees no retrieve call for them.
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    before = futures_stats()
    for step in range(5):
        fb = training.forward_backward([sdk_datum(step)], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
        assert np.isfinite(fb.result(timeout=TIMEOUT_S).metrics["loss:sum"])
        optim.result(timeout=TIMEOUT_S)
    after = futures_stats()
    assert after["retrieves"] - before["retrieves"] <= 1, (before["retrieves"], after["retrieves"])


def test_requests_that_arrive_together_are_recorded_in_one_call(service, ray_driver):
    # An ingress replica sends the submissions that come while its previous one is being recorded in one call
    # (serve.tinker.batched_calls). Four clients send a step at the same moment, a few times: the futures DB must see
    # fewer calls than submissions (a round can miss, when the first request's call returns before the others come).
    clients = [service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
               for _ in range(4)]
    before = futures_stats()
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        for step in range(5):
            futures = list(pool.map(lambda training: training.forward_backward([sdk_datum(step)], "cross_entropy"),
                                    clients))
            for future in futures:
                assert np.isfinite(future.result(timeout=TIMEOUT_S).metrics["loss:sum"])
    after = futures_stats()
    calls = after["burst_calls"] - before["burst_calls"]
    submissions = after["burst_submissions"] - before["burst_submissions"]
    assert submissions == 4 * 5 and calls < submissions, (calls, submissions)
