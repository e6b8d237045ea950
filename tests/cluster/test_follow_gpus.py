"""Trainers follow the cluster: lilo deployed (``--follow-gpus``) on a Ray cluster simulated on this machine
(``ray.cluster_utils.Cluster``) whose head has no GPU, then nodes added with fake GPUs (``num_gpus=1``; the trainers
compute on CPU, ``--device cpu``):

- with no GPU node yet, no trainer runs, and create_model is a 503 saying trainers are starting;
- a node that joins gets a trainer, which takes models (the join-to-trainer and join-to-model times are printed);
- with every trainer full, create_model asks for one more trainer, visible as one waiting for a GPU node, and waits
  for it instead of a 429: the node added next satisfies it and the model lands there;
- a node that leaves takes its trainer along, and its models fail over to a trainer that is left;
- a trainer with no model is let go after --trainer-idle-timeout, never below --min-trainers, and its GPU is left
  free (not refilled) for the autoscaler to take the node back.

The tests run in order on one cluster (each lilo start costs tens of seconds on two cores).

Ray's ``fake_multinode`` autoscaler provider (an end-to-end scale-up and scale-down) is not run here: its test
harness (``ray.cluster_utils.AutoscalingCluster``) runs ``ray stop --force`` when it starts and stops, which kills
every Ray process on the machine (the session cluster's and other sessions' included), and the provider starts its
nodes with Ray's default temp dir and the fixed GCS port 6379 unless reconfigured. What the autoscaler would do is
stood in for by hand here: the pending trainer (the resource demand it reads) is checked, and the node it would
add is added.
"""

import json
import threading
import time

import httpx
import numpy as np
import pytest
import tinker

from helpers import eventually, sdk_datum, service_on_test_cluster, trainers_on

TINY = "lilo/tiny-llama"
# Adapter slots per trainer, and no host or disk tier to page to: two models fill one (with paging tiers, a trainer
# is full only when every tier is).
SLOTS = 2
IDLE_TIMEOUT_S = 8
TRAINER_WAIT_S = 120  # a joined node's trainer loads in seconds here; the bound only has to cover the test's pace


@pytest.fixture(scope="module")
def service():
    with service_on_test_cluster(4, "--follow-gpus", "--device", "cpu", "--base-model", TINY, "--max-adapters",
                                 str(SLOTS), "--sampler-slots", "0", "--host-adapter-mb", "0", "--disk-adapter-gb",
                                 "0", "--min-trainers", "1", "--max-trainers", "3", "--trainer-idle-timeout",
                                 str(IDLE_TIMEOUT_S), "--trainer-wait", str(TRAINER_WAIT_S)) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(service):
    with tinker.ServiceClient(base_url=service.api_url, api_key="tml-local-test") as client:
        yield client


def test_with_no_gpu_node_no_trainer_runs_and_create_model_says_trainers_are_starting(service):
    assert not [trainer for trainer in service.trainers() if trainer["state"] in ("ready", "idle", "starting")]
    with httpx.Client(timeout=30, headers={"X-API-Key": "tml-local-test"}) as http:
        session = http.post(f"{service.api_url}/api/v1/create_session", json={}).json()["session_id"]
        refused = service.create_model(http, session, 0, TINY)
    assert refused.status_code == 503, refused.text
    assert "trainers are starting" in refused.json()["detail"] and "0 GPU(s) so far" in refused.json()["detail"]
    # ...and it asked for a trainer, which waits for a GPU node (the resource demand the autoscaler reads).
    assert [trainer["state"] for trainer in service.trainers()] == ["pending"]


def test_a_joined_gpu_node_gets_a_trainer_that_takes_models(service, sdk):
    joined_at = time.monotonic()
    node = service.add_gpu_node("a")
    service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["state"] in ("ready", "idle")],
                     what="a trainer on the joined node")
    service.figures["join_to_trainer_s"] = time.monotonic() - joined_at
    clients = [sdk.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120) for _ in range(SLOTS)]
    service.figures["join_to_model_s"] = time.monotonic() - joined_at
    for n, client in enumerate(clients):
        assert np.isfinite(client.forward_backward([sdk_datum(n)], "cross_entropy").result(timeout=120)
                           .metrics["loss:sum"])
    # The status counts models on the reconciler's tick (every second, later on a loaded machine): wait for it.
    service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["models"] == SLOTS and t["free_slots"] == 0],
                     timeout_s=30, what=f"{SLOTS} models and no free slot on the joined node's trainer")
    # The cluster's timing view counts the trainers (gauges the reconciler publishes at the end of that tick).
    expected = {"trainers.ready": 1, "trainers.idle": 0, "trainers.starting": 0}
    gauges: dict = {}

    def counted() -> bool:
        gauges.clear()
        gauges.update(httpx.get(f"{service.api_url}/api/v1/timing", headers={"X-API-Key": "tml-local-test"}).json()
                      ["gauges"])
        return {name: gauges.get(name) for name in expected} == expected

    eventually(counted, lambda: f"the gauges {expected}; gauges: {gauges}", timeout_s=10)
    service.clients = clients
    print(f"\n[follow-gpus] {json.dumps(service.figures)}")


def test_with_every_trainer_full_one_more_is_asked_for_and_the_next_node_satisfies_it(service):
    answer: dict = {}

    def create() -> None:
        with httpx.Client(timeout=TRAINER_WAIT_S + 30, headers={"X-API-Key": "tml-local-test"}) as http:
            session = http.post(f"{service.api_url}/api/v1/create_session", json={}).json()["session_id"]
            answer["response"] = service.create_model(http, session, 0, TINY)

    waiting = threading.Thread(target=create)
    waiting.start()
    service.wait_for(lambda ts: [t for t in ts if t["state"] == "pending"], timeout_s=60,
                     what="a trainer waiting for a GPU node")
    joined_at = time.monotonic()
    node = service.add_gpu_node("b")
    waiting.join(timeout=TRAINER_WAIT_S + 40)
    assert answer["response"].status_code == 200, answer["response"].text  # not the 429 of a full cluster
    service.figures["demand_join_to_model_s"] = time.monotonic() - joined_at
    trainers = service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["models"] == 1],
                                what="the new model on the added node's trainer")
    assert not [t for t in trainers if t["state"] == "pending"]
    print(f"\n[follow-gpus] {json.dumps(service.figures)}")


def test_a_node_that_leaves_takes_its_trainer_and_its_models_fail_over(service, sdk):
    # Room on node a for what node b holds: one of a's models goes.
    leaving_node, staying_node = service.nodes["b"], service.nodes["a"]
    kept, unloaded = service.clients
    with httpx.Client(timeout=60, headers={"X-API-Key": "tml-local-test"}) as http:
        assert http.post(f"{service.api_url}/api/v1/unload_model",
                         json={"model_id": unloaded.model_id}).status_code == 200
    service.wait_for(lambda ts: [t for t in trainers_on(ts, staying_node) if t["models"] == 1], what="a slot on a")
    (moving,) = [t for t in service.trainers() if t["node_id"] == leaving_node.node_id]
    service.cluster.remove_node(leaving_node, allow_graceful=False)
    trainers = service.wait_for(lambda ts: [t for t in trainers_on(ts, staying_node) if t["models"] == 2]
                                and not trainers_on(ts, leaving_node), what="b's model restored on a")
    assert moving["name"] not in {trainer["name"] for trainer in trainers}
    assert np.isfinite(kept.forward_backward([sdk_datum(9)], "cross_entropy").result(timeout=120).metrics["loss:sum"])


def test_a_trainer_with_no_model_is_let_go_after_the_idle_timeout_and_its_gpu_is_left_free(service):
    node = service.add_gpu_node("c")
    ready = service.wait_for(lambda ts: [t for t in trainers_on(ts, node) if t["state"] == "idle"],
                             what="an idle trainer on node c")
    idle_since = time.monotonic()
    service.wait_for(lambda ts: not trainers_on(ts, node), timeout_s=IDLE_TIMEOUT_S + 60,
                     what="the idle trainer let go")
    released_after_s = time.monotonic() - idle_since
    assert released_after_s >= IDLE_TIMEOUT_S - 2  # (it was idle a little before the status saw it)
    time.sleep(3)
    trainers = service.trainers()
    assert not trainers_on(trainers, node)  # not refilled
    # Node a's trainer holds models; min-trainers 1 keeps a trainer in any case.
    assert [t for t in trainers if t["node_id"] == service.nodes["a"].node_id]
    assert ready
