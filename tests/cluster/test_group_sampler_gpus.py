"""A vLLM sampler beside a sharded trainer (``--samplers F --trainer-ranks N``, F < 1) takes F of each of the
trainer's N GPUs: it joins the trainer's placement group (whose bundles are whole GPUs, each rank taking 1 - F of
its own) and finds which GPU each bundle holds (``group_gpu_ids``), in rank order, for its engine's N workers.

On a Ray cluster simulated on this machine with a node of fake GPUs (``ray.cluster_utils.Cluster``): Ray hands out
GPU ids there as on a real node, but nothing computes on them, so the ranks and the sampler are stand-ins that only
hold their shares; the engine on those GPUs needs a machine with several (docs/design.md)."""

import json
import subprocess
import sys

from helpers import ray_test_cluster

SHARE = 0.25
TRAINER = "lilo-trainer-7"

PROBE = f"""
import json, sys
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from cluster.sampling.actor import group_gpu_ids, sampler_strategy
from cluster.trainer.actor import rank_placement_group
from cluster.gpu_groups import assigned_gpu_ids

ray.init(address=sys.argv[1], namespace="lilo", logging_level="ERROR")
group = rank_placement_group({TRAINER!r}, 2, {1 - SHARE})  # as start_trainer makes it for ranks taking 1 - F
beside = sampler_strategy(None, {TRAINER!r})  # found by name at once, as start_samplers does after start_trainers


@ray.remote
class Holder:
    def gpus(self):
        return assigned_gpu_ids()

    def group_gpus(self):
        return group_gpu_ids(timeout_s=60)


ranks = [Holder.options(num_cpus=1, num_gpus={1 - SHARE}, scheduling_strategy=PlacementGroupSchedulingStrategy(
    group, placement_group_bundle_index=rank)).remote() for rank in range(2)]
rank_gpus = ray.get([rank.gpus.remote() for rank in ranks], timeout=60)
sampler = Holder.options(num_cpus=0, num_gpus={SHARE}, scheduling_strategy=beside).remote()
print(json.dumps({{"bundles": group.bundle_specs, "ranks": rank_gpus,
                  "sampler": ray.get(sampler.gpus.remote(), timeout=60),
                  "group": ray.get(sampler.group_gpus.remote(), timeout=90)}}))
"""


def test_a_sampler_in_a_sharded_trainers_group_finds_each_ranks_gpu_in_rank_order():
    with ray_test_cluster(head_cpus=1) as cluster:
        cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        probe = subprocess.run([sys.executable, "-c", PROBE, cluster.address], capture_output=True, text=True,
                               timeout=240)
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert [bundle["GPU"] for bundle in found["bundles"]] == [1.0, 1.0]  # whole GPUs, shared by rank and sampler
    (rank0,), (rank1,) = found["ranks"]
    assert rank0 != rank1
    assert found["sampler"] == [rank0]  # its actor holds the share of rank 0's GPU
    assert found["group"] == [rank0, rank1]
