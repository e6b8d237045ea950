"""Through the tinker SDK: clients stepping in lockstep (send a step, wait for it, send the next, as every cookbook
loop does) share their forward_backward passes, and the critical path says what the coalescing window cost."""

import threading

import numpy as np
import tinker
from tinker import types

from lilo.timing import critical_path_metrics

READER = "test-coalescing"
STEPS = 10


def lockstep_client(service, out: dict, started: threading.Barrier) -> None:
    training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
    rng = np.random.default_rng(len(out))
    # Eight rows a step: a pass long enough that a quarter of it covers the few milliseconds between two clients.
    rows = [rng.integers(0, 1000, 65).tolist() for _ in range(8)]
    data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1]),
                        loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * 64}) for row in rows]
    adam = types.AdamParams(learning_rate=1e-4)
    for step in range(STEPS):
        if step == 2:  # two steps teach the trainer each client's rhythm; the interval read below starts here
            out["model_id"] = training.model_id
            started.wait(timeout=120)
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(adam)
        backward.result(timeout=120)
        optim.result(timeout=120)


def test_two_lockstep_sdk_clients_share_their_passes_and_see_the_window_in_their_timing(local_cluster):
    outs = [{}, {}]
    started = threading.Barrier(3)
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        threads = [threading.Thread(target=lockstep_client, args=(service, out, started)) for out in outs]
        for thread in threads:
            thread.start()
        started.wait(timeout=240)
        for out in outs:  # start this reader's interval at step 3 of both
            critical_path_metrics(out["model_id"], base_url=local_cluster.api_url, api_key="tml-local-test",
                                  reset=True, reader=READER)
        for thread in threads:
            thread.join(timeout=600)
        metrics = [critical_path_metrics(out["model_id"], base_url=local_cluster.api_url, api_key="tml-local-test",
                                         reset=True, reader=READER) for out in outs]
    for timing in metrics:
        # Without the window the first client's step ran alone and the other's a moment later (1.0 measured);
        # with it nearly every pass holds both.
        assert timing["lilo/forward_backward.execute.mean_batch"] >= 1.5, timing
        assert timing["lilo/forward_backward.execute.count"] >= 1
    # The wait is the phase of the model whose step came first and was held for the other's: which client that is
    # may be the same every step, so only one of the two need show it.
    assert any("lilo/forward_backward.coalesce_wait.total_s" in timing for timing in metrics), metrics
