"""A request too large for a trainer, through the tinker SDK on a cluster of its own: one no pass can hold is refused
(413) before it runs, one that runs out of a trainer's memory cap (``--trainer-memory-gb``, a real limit on the
trainer process) fails with a message naming it; either way the model is as it was, its next requests run, and no
process of the service died or restarted (Ray's own actor table says so)."""

from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.ports import free_ports
from cluster.reconciler import RECONCILER_ACTOR_NAME
from cluster.recovery import RECOVERY_ACTOR_NAME
from cluster.timing import TIMING_ACTOR_NAME
from test_model_lifetime import forward_loss, home, step, up  # noqa: F401 (home: the fixture)
from test_tinker_sdk import memorize_datum

# The tiny model's trainer holds about 0.7 GB once loaded; a pass of 16k tokens takes about 2.4 GB more.
MEMORY_CAP_GB = 1.5
BATCH_TOKENS = 16384


def long_datum(seed: int, length: int) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, length + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": tokens[1:].tolist(), "weights": [1.0] * length})


def service_actors(dashboard_port: int) -> dict[str, tuple[str, int, int]]:
    """Every actor of the cluster by name (or class): (state, pid, restarts), from Ray's state API."""
    # The cluster uses Ray's token authentication (cluster.local); its token is the machine's.
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    answer = httpx.get(f"http://127.0.0.1:{dashboard_port}/api/v0/actors", params={"limit": 1000}, timeout=30,
                       headers={"authorization": f"Bearer {token}"}).json()
    return {actor.get("name") or actor["class_name"]: (actor["state"], actor["pid"], actor.get("num_restarts", 0))
            for actor in answer["data"]["result"]["result"] if actor["state"] != "DEAD"}


def test_a_request_too_large_for_a_trainer_fails_alone_and_the_service_lives_on(home):  # noqa: F811
    http_port, dashboard_port = free_ports(2)
    up(home, http_port, ("lilo/tiny-llama",), "--trainer-memory-gb", str(MEMORY_CAP_GB),
       "--max-batch-tokens", str(BATCH_TOKENS), "--dashboard-port", str(dashboard_port))
    before = service_actors(dashboard_port)
    head = {FUTURES_ACTOR_NAME, RECONCILER_ACTOR_NAME, RECOVERY_ACTOR_NAME, TIMING_ACTOR_NAME, "SERVE_CONTROLLER_ACTOR"}
    assert head | {"lilo-trainer-0"} <= set(before), before
    data = [memorize_datum()]
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{http_port}", api_key="tml-local") as service:
        training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8, seed=3)
        step(training, data)
        loss = forward_loss(training, data)
        # A pass of 16k tokens under a 1.5 GB cap: an allocation fails in the trainer, the request with it.
        with pytest.raises(tinker.RequestFailedError, match="ran out of this trainer's memory in a pass of 16 seq"):
            training.forward_backward([long_datum(n, 1024) for n in range(16)], "cross_entropy").result(timeout=300)
        # A datum no pass can hold: refused at once, saying how long it is and what fits.
        with pytest.raises(tinker.APIStatusError, match="Datum 0 has 200000 tokens, and a pass on this trainer"
                                                        " holds at most") as refused:
            training.forward_backward([long_datum(0, 200_000)], "cross_entropy").result(timeout=300)
        assert refused.value.status_code == 413
        # Neither took effect, and the model's next steps run as if they were never sent.
        assert forward_loss(training, data) == pytest.approx(loss, rel=1e-6)
        step(training, data)
        assert forward_loss(training, data) < loss
    after = service_actors(dashboard_port)
    assert after == before  # every actor alive, the same process, never restarted: the trainer and the head's
