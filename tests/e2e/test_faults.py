"""Real faults on the session cluster: a trainer killed in the middle of a step, a trainer killed while the recovery
actor is down too, the futures DB actor killed, an ingress replica killed (by ray.kill), SQLite's write lock held by
another process, a response lost after its request was accepted. Every future ends, nothing acknowledged is lost
or runs twice, and the clients go on without a restart.

These run last (marker ``disruptive``): each kills a real process with SIGKILL and waits for Ray and lilo to
recover, so no other test's work overlaps a fault.
"""

import signal
import sqlite3
import threading
import time

import httpx
import numpy as np
import orjson
import psutil
import pytest
import ray
import tinker
from tinker import types
from ray.util.state import list_actors
from tinker.proto.request_conv import forward_backward_request_to_proto

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.recovery import RECOVERY_ACTOR_NAME
from conftest import SHARDED_BASE_MODEL
from helpers import eventually, retrieve_finished, unload_models

pytestmark = pytest.mark.disruptive

TINY = "lilo/tiny-llama"
# The bound: every in-flight future of a killed trainer ends within this.
FUTURES_END_WITHIN_S = 30.0


def datum(seed: int, length: int = 33) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, length).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)})


@pytest.fixture
def created(service, local_cluster):
    """The models a test creates (``created(client)``), unloaded when it ends, so their slots are free again."""
    model_ids: list[str] = []

    def track(client):
        model_ids.append(client.model_id)
        return client

    yield track
    unload_models(local_cluster.api_url, model_ids)


def train_step(client, seed: int) -> float:
    loss = client.forward_backward([datum(seed)], "cross_entropy").result(timeout=120).metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return loss


def forward_loss(client, seed: int) -> float:
    return client.forward([datum(seed)], "cross_entropy").result(timeout=120).metrics["loss:sum"]


def kill(pid: int) -> None:
    process = psutil.Process(pid)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def owner_pid(model_id: str) -> tuple[str, int]:
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    trainer = ray.get(futures.trainer_of.remote(model_id))
    return trainer, ray.get(ray.get_actor(trainer, namespace=NAMESPACE).ready.remote())["pid"]


def test_a_trainer_killed_mid_step_fails_its_in_flight_futures_and_its_models_come_back(service, ray_driver, created):
    victim = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
    victim_trainer, pid = owner_pid(victim.model_id)
    # A model on the other trainer serving the same base model (placement evens out the load: a few tries at most).
    for _ in range(8):
        bystander = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
        if owner_pid(bystander.model_id)[0] != victim_trainer:
            break
    else:
        pytest.fail("every new model went to the victim's trainer")

    train_step(victim, 1)
    victim.save_state("before-kill").result(timeout=120)
    checkpoint_loss = forward_loss(victim, 99)
    train_step(victim, 2)  # completes, but after the checkpoint: the restore loses it
    assert forward_loss(victim, 99) != checkpoint_loss

    bystander_losses: list[float] = []
    stop = threading.Event()

    def keep_training() -> None:
        seed = 100
        while not stop.is_set():
            bystander_losses.append(train_step(bystander, seed))
            seed += 1

    trainer_thread = threading.Thread(target=keep_training)
    trainer_thread.start()
    try:
        # A large step that is running when the process dies, and two more queued behind it.
        in_flight = [victim.forward_backward([datum(seed, 129) for seed in range(64)], "cross_entropy"),
                     victim.optim_step(types.AdamParams(learning_rate=1e-2)),
                     victim.forward_backward([datum(3)], "cross_entropy")]
        time.sleep(0.5)
        killed_at = time.monotonic()
        kill(pid)
        for future in in_flight:
            with pytest.raises(tinker.RequestFailedError) as failed:
                future.result(timeout=FUTURES_END_WITHIN_S)
            assert failed.value.category == "server"
            assert f"Trainer {victim_trainer} stopped before this request finished" in failed.value.message
        assert time.monotonic() - killed_at < FUTURES_END_WITHIN_S

        # The same client goes on: its model is back, restored from its checkpoint (the step after it is lost).
        assert forward_loss(victim, 99) == pytest.approx(checkpoint_loss, rel=1e-6)
        train_step(victim, 4)
    finally:
        stop.set()
        trainer_thread.join(timeout=180)
    assert bystander_losses and all(np.isfinite(bystander_losses))  # the other trainer's model never noticed

    recovery = ray.get_actor(RECOVERY_ACTOR_NAME, namespace=NAMESPACE)
    (event,) = [e for e in ray.get(recovery.history.remote()) if victim.model_id in e["models"]]
    trainer, checkpoint = event["models"][victim.model_id]
    assert event["trainer"] == victim_trainer and checkpoint.endswith("/weights/before-kill")


def recovery_actor_pid() -> int:
    # The session cluster's own address: another Ray instance on the machine must not make the lookup ambiguous.
    (actor,) = list_actors(address=ray.get_runtime_context().gcs_address,
                           filters=[("class_name", "=", "RecoveryActor"), ("state", "=", "ALIVE")])
    return actor.pid


def recoveries_of(model_id: str, within_s: float = 120.0) -> list[dict]:
    """The recovery actor's history entries naming ``model_id``, once there is one."""
    def found() -> list[dict]:
        history = ray.get(ray.get_actor(RECOVERY_ACTOR_NAME, namespace=NAMESPACE).history.remote(), timeout=30)
        return [event for event in history if model_id in event["models"]]

    return eventually(found, f"a recovery of {model_id}", timeout_s=within_s,
                      ignoring=(ray.exceptions.RayActorError, ValueError))  # restarting, or not registered again yet


def test_a_trainer_that_died_while_the_recovery_actor_was_down_is_recovered_when_it_restarts(service, ray_driver,
                                                                                              created):
    client = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
    train_step(client, 1)
    client.save_state("before-both-died").result(timeout=120)
    checkpoint_loss = forward_loss(client, 99)
    trainer, trainer_pid = owner_pid(client.model_id)
    old_recovery_pid = recovery_actor_pid()

    # The recovery actor first, so nobody watches when the trainer dies; Ray restarts both.
    kill(old_recovery_pid)
    kill(trainer_pid)

    # Its new incarnation finds the restarted trainer without the model placed on it, and restores it.
    (event,) = recoveries_of(client.model_id)
    assert recovery_actor_pid() != old_recovery_pid
    assert event["trainer"] == trainer
    assert event["models"][client.model_id][1].endswith("/weights/before-both-died")
    assert forward_loss(client, 99) == pytest.approx(checkpoint_loss, rel=1e-6)
    train_step(client, 2)


def test_a_rank_killed_mid_pass_fails_its_groups_futures_and_the_group_comes_back(service, ray_driver, created):
    client = created(service.create_lora_training_client(base_model=SHARDED_BASE_MODEL, rank=4).result(timeout=120))
    trainer, _ = owner_pid(client.model_id)
    ranks = ray.get(ray.get_actor(trainer, namespace=NAMESPACE).rank_info.remote(), timeout=60)
    assert [rank["rank"] for rank in ranks] == [0, 1]
    train_step(client, 1)
    client.save_state("before-rank-died").result(timeout=120)
    checkpoint_loss = forward_loss(client, 99)

    big = [datum(seed, 257) for seed in range(24)]
    started = time.monotonic()
    client.forward(big, "cross_entropy").result(timeout=120)
    pass_s = time.monotonic() - started  # a forward_backward of it takes longer: killed at this, it is mid-pass
    in_flight = [client.forward_backward(big, "cross_entropy"),
                 client.optim_step(types.AdamParams(learning_rate=1e-2))]
    time.sleep(pass_s)
    killed_at = time.monotonic()
    kill(ranks[1]["pid"])  # the follower: rank 0 finds its collectives broken
    for future in in_flight:
        with pytest.raises(tinker.RequestFailedError) as failed:
            future.result(timeout=FUTURES_END_WITHIN_S)
        assert failed.value.category == "server"
        # The pass under way fails as the group's; what was queued behind it never runs on the broken group.
        assert ("on this trainer's 2 ranks failed" in failed.value.message
                or "stopped before request" in failed.value.message
                or f"Trainer {trainer} stopped before this request finished" in failed.value.message), failed.value
    assert time.monotonic() - killed_at < FUTURES_END_WITHIN_S

    # The group is rebuilt (a new rank 0, a new follower) and the model is restored from its checkpoint.
    (event,) = recoveries_of(client.model_id)
    assert event["trainer"] == trainer and event["models"][client.model_id][1].endswith("/weights/before-rank-died")
    assert forward_loss(client, 99) == pytest.approx(checkpoint_loss, rel=1e-5)
    train_step(client, 4)
    rebuilt = ray.get(ray.get_actor(trainer, namespace=NAMESPACE).rank_info.remote(), timeout=60)
    assert len(rebuilt) == 2 and not {rank["pid"] for rank in rebuilt} & {rank["pid"] for rank in ranks}


def test_killing_the_futures_db_actor_loses_no_acknowledged_request(service, ray_driver, created):
    client = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
    train_step(client, 1)
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    pid = ray.get(futures.stats.remote())["pid"]
    # Acknowledged (each has its request id) and long-polled while the DB actor dies.
    acknowledged = [client.forward_backward([datum(seed, 129) for seed in range(32)], "cross_entropy")
                    for seed in range(2)]
    kill(pid)
    results = [future.result(timeout=120) for future in acknowledged]
    assert all(np.isfinite(result.metrics["loss:sum"]) for result in results)
    assert ray.get(futures.stats.remote())["pid"] != pid  # a new process, on the same file
    train_step(client, 2)  # and new requests work, from the same client


def test_killing_the_ingress_replica_is_retried_by_the_client(service, ray_driver, created):
    client = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
    train_step(client, 1)
    (replica,) = [actor for actor in ray.util.list_named_actors(all_namespaces=True) if "LiloIngress" in actor["name"]]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]))  # Serve's controller starts another
    # The SDK retries what the dead replica dropped (same seq ids: nothing runs twice) until Serve replaces it.
    losses = [train_step(client, seed) for seed in range(2, 5)]
    assert all(np.isfinite(losses))
    (serving,) = [actor for actor in ray.util.list_named_actors(all_namespaces=True) if "LiloIngress" in actor["name"]]
    assert serving["name"] != replica["name"]  # they were served by the replica Serve started in its place


def test_a_held_write_lock_on_the_database_delays_completions_but_leaves_none_pending(service, local_cluster, created):
    client = created(service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120))
    train_step(client, 1)
    step = client.forward_backward([datum(seed, 129) for seed in range(16)], "cross_entropy")
    # Another process takes SQLite's write lock for longer than the store's busy timeout (5 s): the trainer's
    # result write, and the submission below, fail and are retried until it is released.
    with sqlite3.connect(local_cluster.settings.futures_db, isolation_level=None) as other_writer:
        other_writer.execute("BEGIN IMMEDIATE")
        queued_behind_lock = client.optim_step(types.AdamParams(learning_rate=1e-2))
        time.sleep(8)
        other_writer.execute("ROLLBACK")
    assert np.isfinite(step.result(timeout=120).metrics["loss:sum"])
    queued_behind_lock.result(timeout=120)
    with sqlite3.connect(local_cluster.settings.futures_db) as reader:
        (pending,) = reader.execute("SELECT count(*) FROM futures WHERE model_id = ? AND status = 'pending'",
                                    (client.model_id,)).fetchone()
    assert pending == 0


class LoseFirstResponse(httpx.HTTPTransport):
    """A test double for a fault loopback cannot produce by itself: the first forward_backward reaches the server
    and is accepted, but its response is lost on the way back and the client sees a read timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/forward_backward") and not self.lost:
            self.lost.append(orjson.loads(response.read()))
            raise httpx.ReadTimeout("injected: the response was lost", request=request)
        return response


def test_a_submission_retried_after_a_timeout_with_a_new_idempotency_key_runs_once(local_cluster):
    api = f"{local_cluster.api_url}/api/v1"
    transport = LoseFirstResponse()
    with httpx.Client(timeout=60, transport=transport, headers={"X-API-Key": "tml-local-test"}) as http:
        session_id = http.post(f"{api}/create_session", json={}).json()["session_id"]
        created = http.post(f"{api}/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                         "base_model": TINY, "lora_config": {"rank": 4}}).json()
        retrieve_finished(http, f"{api}/retrieve_future", created["request_id"])
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum(1)], loss_fn="cross_entropy"),
            model_id=created["model_id"], seq_id=1)
        body = forward_backward_request_to_proto(request).SerializeToString()
        headers = {"Content-Type": "application/x-protobuf"}
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{api}/forward_backward", content=body, headers={**headers, "X-Idempotency-Key": "first"})
        retried = http.post(f"{api}/forward_backward", content=body, headers={**headers, "X-Idempotency-Key": "again"})
        assert retried.status_code == 200, retried.text
        (lost,) = transport.lost
        assert retried.json()["request_id"] == lost["request_id"]  # the first request's future, not a new one
        retrieve_finished(http, f"{api}/retrieve_future", retried.json()["request_id"])
        timing = http.get(f"{api}/timing", params={"model_id": created["model_id"]}).json()
    unload_models(local_cluster.api_url, [created["model_id"]])
    assert timing["phases"]["forward_backward.execute"]["count"] == 1  # and the trainer ran it once
