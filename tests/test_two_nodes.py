"""lilo deployed onto a two-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster): the trainers
spread over both nodes, and every request still reaches its model's owner."""

import json
import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types

from helpers import free_port, lilo, short_home

TINY = "lilo/tiny-llama"

# Run in a child process: this test process may already be a driver of the session cluster.
INSPECT = """
import json, sys
import ray
ray.init(address=sys.argv[1], namespace="lilo", log_to_driver=False)
from cluster.trainer_actor import trainer_name
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


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "temp_dir": str(short_home())})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_trainers_spread_over_two_nodes_and_requests_reach_their_owner(two_node_cluster):
    home, port = short_home(), free_port()
    started = lilo("up", "--detach", "--address", two_node_cluster.address, "--home", str(home), "--port",
                   str(port), "--dashboard-port", str(free_port()), "--trainers", "2", "--base-model", TINY)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-local-test") as service:
            clients = [service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=120)
                       for _ in range(4)]
            for n, client in enumerate(clients):
                tokens = np.random.default_rng(n).integers(0, 1000, 17).tolist()
                datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16})
                client.forward_backward([datum], "cross_entropy").result(timeout=120)
        model_ids = [client.model_id for client in clients]
        inspected = subprocess.run([sys.executable, "-c", INSPECT, two_node_cluster.address, json.dumps(model_ids)],
                                   capture_output=True, text=True, timeout=120)
        assert inspected.returncode == 0, inspected.stderr
        report = json.loads(inspected.stdout.strip().splitlines()[-1])
    finally:
        stopped = lilo("down", "--home", str(home))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert len({trainer["node_id"] for trainer in report.values()}) == 2  # one trainer per node
    # Each model ran on exactly one trainer, once; both trainers got models.
    owners = {model_id: [name for name, t in report.items() if model_id in t["models"]] for model_id in model_ids}
    assert all(len(names) == 1 for names in owners.values())
    assert all(count == 1 for trainer in report.values() for count in trainer["models"].values())
    assert all(trainer["models"] for trainer in report.values())
