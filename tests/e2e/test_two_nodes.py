"""lilo deployed onto a two-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster): the trainers
spread over both nodes, every request still reaches its model's owner, and when a node leaves, its trainer's
models fail what they had in flight and come back on the node that is left; with checkpoints in an object store,
nothing the node saved leaves with it."""

import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tinker

from cluster.ports import free_ports
from helpers import cli_json, lilo, lilo_down, ray_test_cluster, sdk_datum, short_home
from benchmarks.s3_server import S3Server

TINY = "lilo/tiny-llama"

# Run in a child process: this test process may already be a driver of the session cluster.
INSPECT = """
import json, sys
import ray
ray.init(address=sys.argv[1], namespace="lilo", log_to_driver=False)
from cluster.trainer.config import trainer_name
report = {}
for index in range(2):
    trainer = ray.get_actor(trainer_name(index), namespace="lilo")
    info = ray.get(trainer.ready.remote())
    counts = {}
    for model_id in json.loads(sys.argv[2]):
        snapshot = ray.get(trainer.timing.remote(model_id))
        if snapshot is not None:
            counts[model_id] = snapshot["phases"]["forward_backward.execute"]["count"]
    report[info["name"]] = {"node_id": info["node_id"], "models": counts}
print(json.dumps(report))
"""


def remove_a_node_mid_step(cluster, node, leaving: list, staying: list, futures_db: Path) -> None:
    """Take ``node`` out of the cluster while ``leaving``'s models (placed on it) have a step in flight: the
    service fails those within 30 s and their models serve again, restored elsewhere; ``staying``'s models train
    on throughout."""
    assert leaving and staying
    in_flight = [client.forward_backward([sdk_datum(seed, 129) for seed in range(32)], "cross_entropy")
                 for client in leaving]
    time.sleep(0.5)
    left_at = time.time()
    cluster.remove_node(node, allow_graceful=False)
    for client in staying:
        client.forward_backward([sdk_datum(7)], "cross_entropy").result(timeout=120)
    # The client learns of it once it reaches an ingress again: if Serve's only replica was on that node, Serve
    # first has to replace it (seconds, more on a loaded machine), so the client's wait is bounded loosely...
    for future in in_flight:
        with pytest.raises(tinker.RequestFailedError) as failed:
            future.result(timeout=120)
        assert failed.value.category == "server" and "stopped before this request finished" in failed.value.message
    # ...and the service's own bound is checked where it acts: when it failed them, in the futures DB.
    with sqlite3.connect(futures_db) as db:
        failed_at = [at for (at,) in db.execute(
            f"SELECT finished_at FROM futures WHERE status = 'failed' AND model_id IN ({','.join('?' * len(leaving))})",
            [client.model_id for client in leaving])]
    assert failed_at and max(failed_at) - left_at < 30
    for client in leaving:  # restored on the node that is left (no checkpoint: a fresh adapter), same client
        loss = client.forward_backward([sdk_datum(8)], "cross_entropy").result(timeout=120).metrics["loss:sum"]
        assert np.isfinite(loss)


@pytest.fixture
def two_node_cluster():
    with ray_test_cluster(head_cpus=4) as cluster:
        worker = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster, worker


def test_trainers_spread_over_two_nodes_and_requests_reach_their_owner_even_after_a_node_leaves(two_node_cluster,
                                                                                                   tmp_path):
    """Checkpoints here in a directory both nodes share (--storage): a model of the node that leaves comes back on
    the other from its checkpoint there, the leaving node's own copies deleted."""
    two_node_cluster, worker = two_node_cluster
    home, (port, dashboard_port) = short_home(), free_ports(2)
    started = lilo("up", "--detach", "--address", two_node_cluster.address, "--home", str(home), "--port",
                   str(port), "--dashboard-port", str(dashboard_port), "--trainers", "2", "--base-model", TINY,
                   "--storage", str(tmp_path / "shared"))
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-local-test") as service:
            clients = [service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
                       for _ in range(4)]
            for n, client in enumerate(clients):
                client.forward_backward([sdk_datum(n)], "cross_entropy").result(timeout=120)
            model_ids = [client.model_id for client in clients]
            inspected = subprocess.run([sys.executable, "-c", INSPECT, two_node_cluster.address,
                                        json.dumps(model_ids)], capture_output=True, text=True, timeout=120)
            assert inspected.returncode == 0, inspected.stderr
            report = json.loads(inspected.stdout.strip().splitlines()[-1])
            on_worker = {model_id for trainer in report.values() if trainer["node_id"] == worker.node_id
                         for model_id in trainer["models"]}
            leaving = [client for client in clients if client.model_id in on_worker]
            staying = [client for client in clients if client.model_id not in on_worker]
            kept = leaving[0]
            kept.optim_step(tinker.AdamParams(learning_rate=0.05)).result(timeout=120)
            saved = kept.save_state("kept").result(timeout=120).path
            probe = sdk_datum(5, 33)
            expected = logprobs(kept, probe)
            remove_a_node_mid_step(two_node_cluster, worker, leaving, staying, home / "futures.db")
            shutil.rmtree(home / "nodes" / worker.node_id[:16])
            np.testing.assert_allclose(logprobs(kept, probe).tolist(), expected.tolist(), atol=1e-5)
            loaded = after_node_loss(lambda: service.create_training_client_from_state(saved).result(timeout=120))
            np.testing.assert_allclose(after_node_loss(lambda: logprobs(loaded, probe)).tolist(), expected.tolist(),
                                       atol=1e-5)
    finally:
        lilo_down(home)
        shutil.rmtree(home, ignore_errors=True)
    assert len({trainer["node_id"] for trainer in report.values()}) == 2  # one trainer per node
    # Each model ran on exactly one trainer, once; both trainers got models.
    owners = {model_id: [name for name, t in report.items() if model_id in t["models"]] for model_id in model_ids}
    assert all(len(names) == 1 for names in owners.values())
    assert all(count == 1 for trainer in report.values() for count in trainer["models"].values())
    assert all(trainer["models"] for trainer in report.values())


def trainer_nodes(address: str, model_ids: list[str]) -> dict[str, str]:
    """``model id -> node id`` of the trainer that ran each model (one forward_backward each)."""
    inspected = subprocess.run([sys.executable, "-c", INSPECT, address, json.dumps(model_ids)], capture_output=True,
                               text=True, timeout=120)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout.strip().splitlines()[-1])
    return {model_id: trainer["node_id"] for trainer in report.values() for model_id in trainer["models"]}


def s3_away_while_saving(s3: S3Server, client) -> None:
    """A save while the store is away fails, saying so (and stays unlisted: the caller lists)."""
    s3.stop()
    try:
        with pytest.raises(tinker.RequestFailedError, match="could not be stored, so it is not saved"):
            client.save_state("lost").result(timeout=120)
    finally:
        s3.restart()


def after_node_loss(call, within_s: float = 120.0):
    """``call()``, retried while it fails because a trainer was lost or is being replaced after its node left (a
    server failure whose message asks to send the request again in a few seconds), for up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except tinker.RequestFailedError as failed:
            if failed.category != "server" or time.monotonic() > deadline:
                raise
            time.sleep(2)


def logprobs(client, datum):
    return client.forward([datum], "cross_entropy").result(timeout=180).loss_fn_outputs[0]["logprobs"]


def test_what_a_trainer_saved_to_the_object_store_outlives_its_node(two_node_cluster, tmp_path):
    """Checkpoints in an S3-compatible store (moto's server on loopback): a save while the store is away fails with
    a message and stays unlisted; after the node whose trainer saved the others leaves, and its own copies are
    deleted, the model comes back from the store on the other node with its saved weights, and its checkpoints
    load, sample and download there, by the store's own links. (A directory both nodes share: the test above.)"""
    two_node_cluster, worker = two_node_cluster
    s3 = S3Server()
    storage = s3.uri("lilo")
    home, (port, dashboard_port) = short_home(), free_ports(2)
    started = lilo("up", "--detach", "--address", two_node_cluster.address, "--home", str(home), "--port",
                   str(port), "--dashboard-port", str(dashboard_port), "--trainers", "2", "--base-model", TINY,
                   "--storage", storage)
    assert started.returncode == 0, started.stdout + started.stderr
    api = SimpleNamespace(api_url=f"http://127.0.0.1:{port}")
    probe = sdk_datum(5, 33)
    try:
        with tinker.ServiceClient(base_url=api.api_url, api_key="tml-local-test") as service:
            clients = [service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
                       for _ in range(3)]
            for n, client in enumerate(clients):
                client.forward_backward([sdk_datum(n)], "cross_entropy").result(timeout=120)
                client.optim_step(tinker.AdamParams(learning_rate=0.05)).result(timeout=120)
            nodes = trainer_nodes(two_node_cluster.address, [client.model_id for client in clients])
            leaving = next(client for client in clients if nodes[client.model_id] == worker.node_id)
            saved = leaving.save_state("kept").result(timeout=120).path
            for_sampler = leaving.save_weights_for_sampler("kept").result(timeout=120).path
            expected = logprobs(leaving, probe)
            prompt = tinker.ModelInput.from_ints(probe.model_input.to_ints()[:8])
            greedy = tinker.SamplingParams(max_tokens=6, temperature=0.0)
            sampled = service.create_sampling_client(model_path=for_sampler).result(timeout=120).sample(
                prompt, 1, greedy).result(timeout=120).sequences[0].tokens

            s3_away_while_saving(s3, leaving)
            listed = service.create_rest_client().list_checkpoints(leaving.model_id).result(timeout=120)
            assert sorted(checkpoint.checkpoint_id for checkpoint in listed.checkpoints) == [
                "sampler_weights/kept", "weights/kept"]

            two_node_cluster.remove_node(worker, allow_graceful=False)
            shutil.rmtree(home / "nodes" / worker.node_id[:16])  # what the node kept of its own is gone too
            # The model comes back on the other node from its checkpoint in the store (the SDK retries the 503s
            # while it is being restored; a request sent before Ray saw the node go fails, as one in flight does).
            restored = after_node_loss(lambda: logprobs(leaving, probe))
            np.testing.assert_allclose(restored.tolist(), expected.tolist(), atol=1e-5)
            loaded = after_node_loss(lambda: service.create_training_client_from_state(saved).result(timeout=120))
            np.testing.assert_allclose(after_node_loss(lambda: logprobs(loaded, probe)).tolist(), expected.tolist(),
                                       atol=1e-5)
            assert after_node_loss(lambda: service.create_sampling_client(model_path=for_sampler).result(
                timeout=120).sample(prompt, 1, greedy).result(timeout=120).sequences[0].tokens) == sampled
            # Downloaded by the real CLI through the store's own signed URLs: the bytes never pass through lilo.
            external = after_node_loss(lambda: loaded.save_weights_external("ext").result(timeout=120).path)
            urls = service.create_rest_client().get_external_weights_urls(external).result(timeout=120).urls
            assert urls and all(url.startswith(f"http://127.0.0.1:{s3.port}/{s3.bucket}/") for url in urls.values())
            downloaded = cli_json(api, "checkpoint", "download", external, "--output", str(tmp_path), "--force")
            assert sorted(path.name for path in Path(downloaded["destination"]).iterdir()) == [
                "adapter_config.json", "adapter_model.safetensors"]
    finally:
        try:
            lilo_down(home)
        finally:
            s3.stop()
        shutil.rmtree(home, ignore_errors=True)
