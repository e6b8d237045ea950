"""The benchmarks' bare front (benchmarks/bare_service.py: lilo's engine under a bare ASGI app, the machine's ceiling
that bench_service and bench_op_latency measure lilo against) serves the real SDK: a LoRA model is created, trained a
step, its loss comes back, and its critical path splits the step as a trainer's does."""

from __future__ import annotations

import math

from benchmarks.bare_service import bare_service
from cluster.ports import free_ports
from lilo.timing import critical_path_metrics


def test_the_sdk_trains_a_step_against_the_bare_front() -> None:
    import tinker
    from tinker import types

    with bare_service(free_ports(1)[0], max_adapters=2) as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-bare")
        training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4})
        backward = training.forward_backward([datum], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
        output = backward.result()
        optim.result()
        metrics = critical_path_metrics(training.model_id, base_url=base_url, reset=False)
        service.close("success").result(timeout=60)

    logprobs = output.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(logprobs) == 4 and all(math.isfinite(value) and value < 0 for value in logprobs)
    assert metrics["lilo/forward_backward.execute.count"] == 1
    assert metrics["lilo/optim_step.execute.count"] == 1
