"""The official tinker SDK (0.38.0), unchanged, trains a LoRA adapter against the local cluster."""

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import SHARDED_BASE_MODEL


def memorize_datum() -> types.Datum:
    tokens = np.random.default_rng(0).integers(0, 1000, 24).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 23})


def test_the_sdk_trains_an_adapter_and_its_loss_falls(local_cluster):
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
        train_until_the_loss_falls(training)


def train_until_the_loss_falls(training) -> None:
    data = [memorize_datum()]
    losses = []
    # 5e-3 falls steadily here; 2e-2 made Adam overshoot now and then (the loss doubled on some steps).
    for _ in range(6):
        result = training.forward_backward(data, "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=120)
        losses.append(result.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0]
    assert len(result.loss_fn_outputs[0]["logprobs"].tolist()) == 23
    # forward() runs the same pass without touching weights or gradients: a forward_backward right after it, with
    # no step between, reports the same loss.
    forward = training.forward(data, "cross_entropy").result(timeout=120)
    current = training.forward_backward(data, "cross_entropy").result(timeout=120)
    assert forward.metrics["loss:sum"] == pytest.approx(current.metrics["loss:sum"], rel=1e-5)
    assert forward.metrics["loss:sum"] < losses[0]


def test_an_unknown_base_model_is_refused_with_a_message(local_cluster):
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        with pytest.raises(tinker.APIStatusError, match="is not served here"):
            service.create_lora_training_client(base_model="no/such-model", rank=8).result(timeout=120)


def test_a_base_model_named_with_tinkers_context_suffix_trains_a_full_context_datum_among_short_ones(local_cluster):
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        with pytest.raises(tinker.APIStatusError, match="context of 512 tokens, fewer than the 262144") as refused:
            service.create_lora_training_client(base_model="lilo/tiny-llama:peft:262144", rank=8).result(timeout=120)
        assert refused.value.status_code == 422
        training = service.create_lora_training_client(base_model="lilo/tiny-llama:peft:512", rank=8)
        training = training.result(timeout=120)
        assert training.get_info().model_data.model_name == "lilo/tiny-llama"
        tokens = np.random.default_rng(5).integers(0, 1000, 512).tolist()
        full = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 511})
        short = memorize_datum()
        # Packed into one stream (or the long one alone, recomputed): each datum's outputs are its own.
        together = training.forward([short, full, short], "cross_entropy").result(timeout=120).loss_fn_outputs
        alone = training.forward([full], "cross_entropy").result(timeout=120).loss_fn_outputs
        assert [len(out["logprobs"].tolist()) for out in together] == [23, 511, 23]
        assert np.allclose(together[1]["logprobs"].tolist(), alone[0]["logprobs"].tolist(), atol=1e-5)
        assert together[0]["logprobs"].tolist() == pytest.approx(together[2]["logprobs"].tolist(), abs=1e-5)


def test_steps_after_a_refused_request_still_run(local_cluster):
    # The SDK spends a seq_id on every call, refused or not: the model's next steps must not wait for the refused one.
    tokens = list(range(1, 25))
    bad = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 7})
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
        with pytest.raises(tinker.APIStatusError, match="has 7 entries"):
            training.forward_backward([bad], "cross_entropy").result(timeout=60)
        with pytest.raises(tinker.APIStatusError, match="is not allowed"):
            training.save_state("../outside").result(timeout=60)
        result = training.forward_backward([memorize_datum()], "cross_entropy").result(timeout=60)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert result.metrics["loss:sum"] > 0
        assert training.save_state("after-refusals").result(timeout=60).path.endswith("/weights/after-refusals")


def test_a_retried_request_that_was_recorded_but_never_handed_over_runs(local_cluster, ray_driver):
    import httpx
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE
    from helpers import AUTH, retrieve_finished
    from lilo.futures.store import Submission

    # The fault: an ingress that recorded the request and died (or lost its client) before handing it to the
    # trainer. It cannot be caused on cue, so the request is recorded here the way the ingress records it, and no
    # more.
    adam = {"learning_rate": 1e-3}
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service, \
            httpx.Client(headers=AUTH, timeout=60) as http:
        created = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4)
        model_id = created.result(timeout=120).model_id
        ray.get(futures.submit_once.remote(Submission(model_id, "optim_step", adam, seq_id=1, tenant="local",
                                                      routed=True)))
        # The client's retry of it, then its next step: both run.
        for seq_id in (1, 2):
            response = http.post(f"{local_cluster.api_url}/api/v1/optim_step",
                                 json={"model_id": model_id, "seq_id": seq_id, "adam_params": adam})
            assert response.status_code == 200, response.text
            result = retrieve_finished(http, f"{local_cluster.api_url}/api/v1/retrieve_future",
                                       response.json()["request_id"], polls=2)
            assert "grad_norm:mean" in result.json()["metrics"], result.text


@pytest.mark.parametrize("recorded_model", [False, True], ids=["before-its-record", "before-its-start"])
def test_a_retried_creation_that_stopped_half_way_is_finished(local_cluster, ray_driver, recorded_model):
    import httpx
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE
    from helpers import AUTH, retrieve_finished, unload_models
    from lilo.futures.store import Submission

    api = f"{local_cluster.api_url}/api/v1"
    body = {"model_seq_id": 0, "base_model": "lilo/tiny-llama", "lora_config": {"rank": 4}}
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    with httpx.Client(headers=AUTH, timeout=60) as http:
        session_id = http.post(f"{api}/create_session", json={}).json()["session_id"]
        model_id = f"{session_id}:train:0"
        # The fault: an ingress that died after recording the creation (and, in the second case, the model's
        # record too) but before starting the model on its trainer. It cannot be caused on cue, so the records are
        # made here the way the ingress makes them, and no more.
        ray.get(futures.submit_once.remote(Submission(
            model_id, "create_model", {"base_model": body["base_model"], "lora": body["lora_config"]}, seq_id=0,
            tenant="local", trainer="lilo-trainer-1")))
        if recorded_model:
            ray.get(futures.add_model.remote(model_id, body["base_model"], body["lora_config"], tenant="local",
                                             session_id=session_id, trainer="lilo-trainer-1"))
        retried = http.post(f"{api}/create_model", json={**body, "session_id": session_id})
        assert retried.status_code == 200, retried.text
        created = retrieve_finished(http, f"{api}/retrieve_future", retried.json()["request_id"], polls=2)
        assert created.json()["model_id"] == model_id, created.text
        assert ray.get(ray.get_actor("lilo-trainer-1", namespace=NAMESPACE).has_model.remote(model_id))
    unload_models(local_cluster.api_url, [model_id])


def test_a_submission_its_trainer_refuses_fails_its_future_too(local_cluster, ray_driver):
    import uuid

    import httpx
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE

    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    model_id = f"ghost-{uuid.uuid4().hex[:8]}"  # placed on a trainer that never created it
    ray.get(futures.add_model.remote(model_id, "lilo/tiny-llama", {"rank": 4}, trainer="lilo-trainer-0"))
    from helpers import AUTH, pending_requests

    response = httpx.post(f"{local_cluster.api_url}/api/v1/optim_step", timeout=60, headers=AUTH,
                          json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
    # What a restarted trainer answers until the recovery actor has taken the model off it: retry (the SDK does).
    assert response.status_code == 503
    assert "did not take effect. The model is being restored" in response.json()["detail"]
    assert pending_requests(local_cluster.settings.futures_db, model_id) == 0  # recorded, and failed: never pending


def test_closing_the_service_client_unloads_its_models_and_frees_their_slots(local_cluster, ray_driver):
    import httpx
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE
    from cluster.placement import named_actor
    from helpers import AUTH, eventually

    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
        training.forward_backward([memorize_datum()], "cross_entropy").result(timeout=120)
        model_id = training.model_id
        futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
        trainer = named_actor(ray.get(futures.trainer_of.remote(model_id)))
        assert model_id in ray.get(trainer.model_ids.remote())
    # Leaving the block closed the client (sessions/{id}/finish): no client can reach the model any more.
    info = httpx.post(f"{local_cluster.api_url}/api/v1/get_info", json={"model_id": model_id}, headers=AUTH,
                      timeout=60)
    assert info.status_code == 410 and "was unloaded" in info.json()["detail"]
    eventually(lambda: model_id not in ray.get(trainer.model_ids.remote()), "its adapter slot free again",
               every_s=0.2)


# On a trainer of one rank, and on the session cluster's trainer sharded over two.
@pytest.mark.parametrize("base_model", ["lilo/tiny-llama", SHARDED_BASE_MODEL])
def test_save_state_then_load_state_resumes_where_it_was(local_cluster, base_model):
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model=base_model, rank=4).result(timeout=120)
        data = [memorize_datum()]
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result(timeout=120)
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
        at_save = training.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
        saved = training.save_state("two-steps").result(timeout=120)
        assert saved.path.startswith("tinker://") and saved.path.endswith("/weights/two-steps")
        training.forward_backward(data, "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)
        moved = training.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
        training.load_state_with_optimizer(saved.path).result(timeout=120)
        restored = training.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
        assert moved != at_save and restored == pytest.approx(at_save, rel=1e-6)
        sampler = training.save_weights_for_sampler("for-sampling").result(timeout=120)
        assert sampler.path.endswith("/sampler_weights/for-sampling")
