"""Through the tinker SDK: clients stepping in lockstep (send a step, wait for it, send the next, as every cookbook
loop does) share their forward_backward passes, and the critical path says what the coalescing window cost."""

import threading
import time

import numpy as np
from tinker import types

from helpers import API_KEY, two_on_one_trainer, unload_models
from lilo.timing import critical_path_metrics

READER = "test-coalescing"
STEPS = 10
# The second client's think time beyond the first's: well inside the window (a quarter of a pass of ~0.35 s here,
# at most 100 ms), so every pass the first client's step starts waits for the second's.
LAG_S = 0.02


def lockstep_client(training, seed: int, started: threading.Barrier, lag_s: float) -> None:
    """Step in lockstep, each step sent ``lag_s`` after the last one's result: two clients whose results come
    back together (one futures tick) would otherwise often send their steps within the same microseconds, and a
    pass that found both queued had nothing to wait for."""
    rng = np.random.default_rng(seed)
    # Eight rows a step: a pass long enough that a quarter of it covers the few milliseconds between two clients.
    rows = [rng.integers(0, 1000, 65).tolist() for _ in range(8)]
    data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1]),
                        loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * 64}) for row in rows]
    adam = types.AdamParams(learning_rate=1e-4)
    for step in range(STEPS):
        if step == 2:  # two steps teach the trainer each client's rhythm; the interval read below starts here
            started.wait(timeout=120)
        time.sleep(lag_s)
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(adam)
        backward.result(timeout=120)
        optim.result(timeout=120)


def timing_of(local_cluster, model_id: str) -> dict:
    return critical_path_metrics(model_id, base_url=local_cluster.api_url, api_key=API_KEY, reset=True,
                                 reader=READER)


def test_two_lockstep_sdk_clients_share_their_passes_and_see_the_window_in_their_timing(
        service, local_cluster, ray_driver):
    created = [service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
               for _ in range(3)]
    try:
        # Only models on one trainer can share a pass: two of the three are.
        clients = two_on_one_trainer(created)
        started = threading.Barrier(3)
        threads = [threading.Thread(target=lockstep_client, args=(client, seed, started, LAG_S * seed))
                   for seed, client in enumerate(clients)]
        for thread in threads:
            thread.start()
        started.wait(timeout=240)
        for client in clients:  # start this reader's interval at step 3 of both
            timing_of(local_cluster, client.model_id)
        for thread in threads:
            thread.join(timeout=600)
        metrics = [timing_of(local_cluster, client.model_id) for client in clients]
    finally:
        unload_models(local_cluster.api_url, [client.model_id for client in created])
    for timing in metrics:
        # Without the window the first client's step ran alone and the other's a moment later (1.0 measured);
        # with it nearly every pass holds both.
        assert timing["lilo/forward_backward.execute.mean_batch"] >= 1.5, timing
        assert timing["lilo/forward_backward.execute.count"] >= 1
    # The wait is a phase of both models of the pass that held its window for the second client's step.
    assert all(timing.get("lilo/forward_backward.coalesce_wait.count", 0) >= 3 for timing in metrics), metrics
