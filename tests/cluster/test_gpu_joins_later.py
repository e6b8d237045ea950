"""A GPU node that joins an existing cluster later gets a trainer, with no flag: `lilo up --address` on a Ray
cluster simulated on this machine (``ray.cluster_utils.Cluster``) whose head has no GPU starts a CPU trainer, so
the service trains at once, and follows the GPUs; then a node with a fake GPU joins (``num_gpus=1``; the trainers
compute on CPU, ``--device cpu``), as one added by hand with `ray start --address` would:

- a trainer comes up on the joined node (the time from adding the node to the trainer being ready is printed, and
  of it the Ray node's own start);
- a model created after that goes to it, while a model created before keeps training on the CPU trainer;
- once its model is unloaded, the CPU trainer is let go after the idle timeout, although --min-trainers is 1.

The tests run in order on one cluster (each lilo start costs tens of seconds on two cores).
"""

import json
import time

import httpx
import numpy as np
import pytest
import tinker

from cluster.reconciler import REGISTRY_REFRESH_S
from helpers import sdk_datum, service_on_test_cluster, trainers_on

TINY = "lilo/tiny-llama"
IDLE_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def service():
    with service_on_test_cluster(4, "--device", "cpu", "--base-model", TINY,
                                 "--trainer-idle-timeout", str(IDLE_TIMEOUT_S)) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(service):
    with tinker.ServiceClient(base_url=service.api_url, api_key="tml-local-test") as client:
        yield client


def loss_of(client, seed: int) -> float:
    return client.forward_backward([sdk_datum(seed)], "cross_entropy").result(timeout=120).metrics["loss:sum"]


def test_with_no_gpu_yet_a_cpu_trainer_on_the_head_trains_at_once(service, sdk):
    (trainer,) = service.trainers()
    assert (trainer["node_id"], trainer["gpu"]) == (service.cluster.head_node.node_id, False)
    service.before = sdk.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
    assert np.isfinite(loss_of(service.before, 0))
    assert [t["models"] for t in service.trainers()] == [1]


def test_a_gpu_node_that_joins_later_gets_a_trainer_without_a_flag(service):
    joined_at = time.monotonic()
    node = service.add_gpu_node("gpu")
    service.figures["add_node_s"] = round(time.monotonic() - joined_at, 2)  # the Ray node's own start
    trainers = service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["state"] in ("ready", "idle")],
                                what="a trainer on the joined GPU node")
    service.figures["join_to_trainer_s"] = round(time.monotonic() - joined_at, 2)
    assert [t["gpu"] for t in trainers_on(trainers, node)] == [True]
    print(f"\n[gpu-joins-later] {json.dumps(service.figures)}")


def test_a_model_created_after_goes_to_the_gpu_trainer_and_one_created_before_keeps_training_on_the_cpu(service,
                                                                                                         sdk):
    time.sleep(REGISTRY_REFRESH_S)  # every API replica's copy of the registry has the GPU trainer by now
    after = sdk.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
    assert np.isfinite(loss_of(after, 1)) and np.isfinite(loss_of(service.before, 2))
    trainers = service.trainers()
    (gpu_trainer,) = trainers_on(trainers, service.nodes["gpu"])
    (cpu_trainer,) = trainers_on(trainers, service.cluster.head_node)
    assert (gpu_trainer["models"], cpu_trainer["models"]) == (1, 1)


def test_the_cpu_trainer_is_let_go_once_idle_although_min_trainers_is_one(service):
    with httpx.Client(timeout=60, headers={"X-API-Key": "tml-local-test"}) as http:
        unloaded = http.post(f"{service.api_url}/api/v1/unload_model", json={"model_id": service.before.model_id})
    assert unloaded.status_code == 200, unloaded.text
    trainers = service.wait_for(lambda ts: not trainers_on(ts, service.cluster.head_node),
                                timeout_s=IDLE_TIMEOUT_S + 60, what="the idle CPU trainer let go")
    assert [(t["node_id"], t["models"]) for t in trainers] == [(service.nodes["gpu"].node_id, 1)]
