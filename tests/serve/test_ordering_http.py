"""Requests of one model that arrive out of order over HTTP still run in seq_id order."""

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from helpers import AUTH, retrieve_finished

TINY = "lilo/tiny-llama"


def short_datum(seed: int, length: int = 8) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, length + 1).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length})


def test_a_batch_over_1024_datums_is_chunked_and_runs_whole(local_cluster):
    # The SDK splits more than 1,024 datums into chunks with consecutive seq_ids and sends them concurrently.
    data = [short_datum(n) for n in range(1100)]
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
        forward = training.forward(data, "cross_entropy").result(timeout=300)
        backward = training.forward_backward(data, "cross_entropy").result(timeout=300)
    assert len(backward.loss_fn_outputs) == len(forward.loss_fn_outputs) == 1100
    # forward leaves the weights alone, so both passes see the same adapter: the same loss, chunk by chunk.
    assert backward.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)
    for ours, theirs in zip(forward.loss_fn_outputs, backward.loss_fn_outputs):
        assert np.allclose(ours["logprobs"].tolist(), theirs["logprobs"].tolist(), rtol=1e-5, atol=1e-6)


def test_an_optim_step_sent_before_its_forward_backward_waits_for_it(local_cluster):
    api = f"{local_cluster.api_url}/api/v1"
    with httpx.Client(timeout=60, headers=AUTH) as http:
        session_id = http.post(f"{api}/create_session", json={}).json()["session_id"]
        created = http.post(f"{api}/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                         "base_model": TINY, "lora_config": {"rank": 4}}).json()
        retrieve_finished(http, f"{api}/retrieve_future", created["request_id"])
        model_id = created["model_id"]
        # seq 2 (the optimizer step) arrives first; it must not run before seq 1 has accumulated gradients.
        optim = http.post(f"{api}/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                    "adam_params": {"learning_rate": 1e-3}})
        assert optim.status_code == 200, optim.text
        time.sleep(0.5)
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[short_datum(1)], loss_fn="cross_entropy"),
            model_id=model_id, seq_id=1)
        backward = http.post(f"{api}/forward_backward", content=forward_backward_request_to_proto(request)
                             .SerializeToString(), headers={"Content-Type": "application/x-protobuf"})
        assert backward.status_code == 200, backward.text
        retrieve_finished(http, f"{api}/retrieve_future", backward.json()["request_id"])
        result = retrieve_finished(http, f"{api}/retrieve_future", optim.json()["request_id"]).json()
    # A step taken before any gradient existed would report a zero norm.
    assert result["metrics"]["grad_norm:mean"] > 0
