"""Through the SDK (0.38.0): a model created with DimuonOptimizerConfig trains with DimuonParams steps, refuses
AdamParams, and save_state / create_training_client_from_state_with_optimizer resume it with its optimizer; a new run
from its weights alone trains with AdamW, the default."""

import pytest
from tinker import types

from helpers import sdk_datum, unload_models

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120
DATA = [sdk_datum(seed, length=24) for seed in range(2)]


def step(training, params) -> float:
    backward = training.forward_backward(DATA, "cross_entropy")
    training.optim_step(params).result(timeout=TIMEOUT_S)
    return backward.result(timeout=TIMEOUT_S).metrics["loss:sum"]


def test_dimuon_trains_refuses_adam_steps_and_resumes_from_its_state(service, local_cluster):
    dimuon = types.DimuonParams(learning_rate=5e-2)
    training = service.create_lora_training_client(base_model=TINY, rank=4,
                                                   optimizer=types.DimuonOptimizerConfig()).result(timeout=TIMEOUT_S)
    created = [training]
    try:
        losses = [step(training, dimuon) for _ in range(6)]
        assert losses[-1] < 0.85 * losses[0], losses
        with pytest.raises(Exception, match="trains with dimuon"):
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=TIMEOUT_S)
        saved = training.save_state("dimuon-6").result(timeout=TIMEOUT_S).path
        resumed = service.create_training_client_from_state_with_optimizer(saved).result(timeout=TIMEOUT_S)
        created.append(resumed)
        assert step(resumed, dimuon) < losses[0]  # its optimizer and momentum came back with it
        fresh = service.create_training_client_from_state(saved).result(timeout=TIMEOUT_S)  # weights only: AdamW
        created.append(fresh)
        assert step(fresh, types.AdamParams(learning_rate=1e-3)) < losses[0]
        with pytest.raises(Exception, match="trains with adamw"):
            fresh.optim_step(dimuon).result(timeout=TIMEOUT_S)
    finally:
        unload_models(local_cluster.api_url, [client.model_id for client in created])
