"""Sharded trainers follow the cluster: lilo deployed (``--follow-gpus --trainer-ranks 2``) on a Ray cluster simulated
on this machine (``ray.cluster_utils.Cluster``, as in test_follow_gpus.py) whose nodes have fake GPUs; each trainer
is a group of two ranks (processes computing on CPU over gloo, ``--device cpu``), one fake GPU each:

- a node of 4 GPUs gets two trainers of 2 ranks, which take models, and a model trains on one through the SDK;
- with every group full, create_model asks for a whole group (a pending placement group: the resource demand the
  autoscaler reads), which the node of 2 GPUs added next satisfies;
- a group with no model is let go after --trainer-idle-timeout, and its 2 GPUs are left free (its placement group
  gone, not refilled).

The tests run in order on one cluster.
"""

import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import tinker

from helpers import sdk_datum, service_on_test_cluster, trainers_on
from serve.tinker.training import model_id_for

TINY = "lilo/tiny-llama"
RANKS = 2
SLOTS = 2  # adapter slots per trainer, no tier to page to: two models fill a group
IDLE_TIMEOUT_S = 10
TRAINER_WAIT_S = 120


@pytest.fixture(scope="module")
def service():
    with service_on_test_cluster(4, "--follow-gpus", "--trainer-ranks", str(RANKS), "--device", "cpu",
                                 "--base-model", TINY, "--max-adapters", str(SLOTS), "--sampler-slots", "0",
                                 "--host-adapter-mb", "0", "--disk-adapter-gb", "0", "--min-trainers", "1",
                                 "--max-trainers", "3", "--trainer-idle-timeout", str(IDLE_TIMEOUT_S),
                                 "--trainer-wait", str(TRAINER_WAIT_S)) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(service):
    with tinker.ServiceClient(base_url=service.api_url, api_key="tml-local-test") as client:
        yield client


def free_gpus(service, node) -> float:
    """The GPUs Ray has free on ``node`` (asked from a driver of its own: this process is on another cluster)."""
    probe = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
             "print(json.dumps({n['NodeID']: n for n in ray.nodes()}[%r]['Resources'].get('GPU', 0) - sum("
             "float(b.get('GPU', 0)) for p in ray.util.placement_group_table().values() if p['state'] != 'REMOVED'"
             " for i, b in p['bundles'].items() if p['bundles_to_node_id'].get(i) == %r)))"
             % (service.cluster.address, node.node_id, node.node_id))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


def test_a_node_of_four_gpus_gets_two_groups_of_two_that_take_models(service, sdk):
    node = service.add_gpu_node("a", gpus=4)
    trainers = service.wait_for(lambda ts: len([t for t in trainers_on(ts, node) if t["state"] in ("ready", "idle")])
                                == 2, timeout_s=TRAINER_WAIT_S, what="two groups on the node of four GPUs")
    assert [t["ranks"] for t in trainers_on(trainers, node)] == [RANKS, RANKS]
    assert free_gpus(service, node) == 0
    # Both groups filled (before the idle timeout lets one go).
    service.clients = [sdk.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
                       for _ in range(2 * SLOTS)]
    service.wait_for(lambda ts: [t["models"] for t in trainers_on(ts, node)] == [SLOTS, SLOTS],
                     what="both groups full")
    training = service.clients[0]
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward([sdk_datum(0)], "cross_entropy").result(timeout=120)
                      .metrics["loss:sum"])
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert np.isfinite(losses).all() and losses[1] < losses[0]


def test_with_every_group_full_a_whole_group_is_asked_for_and_the_next_node_satisfies_it(service, sdk):
    answer: dict = {}

    def create() -> None:
        with httpx.Client(timeout=TRAINER_WAIT_S + 30, headers={"X-API-Key": "tml-local-test"}) as http:
            session = http.post(f"{service.api_url}/api/v1/create_session", json={}).json()["session_id"]
            answer["response"] = service.create_model(http, session, 0, TINY)
            answer["model_id"] = model_id_for(session, 0)

    waiting = threading.Thread(target=create)
    waiting.start()
    trainers = service.wait_for(lambda ts: [t for t in ts if t["state"] == "pending"], timeout_s=60,
                                what="a group waiting for a node of two GPUs")
    assert [t["ranks"] for t in trainers if t["state"] == "pending"] == [RANKS]
    node = service.add_gpu_node("b", gpus=RANKS)
    waiting.join(timeout=TRAINER_WAIT_S + 40)
    assert answer["response"].status_code == 200, answer["response"].text  # not the 429 of a full cluster
    trainers = service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["models"] == 1],
                                what="the new model on the added node's group")
    assert [t["ranks"] for t in trainers_on(trainers, node)] == [RANKS]
    assert not [t for t in trainers if t["state"] == "pending"]
    service.added_model = answer["model_id"]


def test_an_idle_group_is_let_go_and_its_gpus_are_left_free(service):
    node = service.nodes["b"]
    with httpx.Client(timeout=60, headers={"X-API-Key": "tml-local-test"}) as http:
        unloaded = http.post(f"{service.api_url}/api/v1/unload_model", json={"model_id": service.added_model})
        assert unloaded.status_code == 200, unloaded.text
    service.wait_for(lambda ts: not trainers_on(ts, node), timeout_s=IDLE_TIMEOUT_S + 60,
                     what="the idle group let go")
    time.sleep(3)
    assert not trainers_on(service.trainers(), node)  # not refilled: the autoscaler may take the node back
    assert free_gpus(service, node) == RANKS
