"""The follower ranks of a sharded trainer (``lilo.backend.sharding``): Ray actors in the trainer's placement group.

A trainer of N ranks is its ``TrainerActor`` (rank 0) and N - 1 ``RankActor``s, one per further bundle of the
placement group ``start_trainer`` made for it (one GPU each, packed on one node; on CPU one CPU each). Rank 0
starts them as it starts: they are its own actors, so they die with its process, and a restarted rank 0 starts a
fresh group. A pass that fails on any rank (one died, a collective timed out) leaves the group out of step, and so
does a follower's death at any time (rank 0 holds a call open on each: ``RankPeers.watch``). Rank 0 then stops its
engine (what is queued fails), exits after a moment (the failures' results written first), Ray restarts it in its
bundle, and the recovery actor restores its models as after any trainer restart (``cluster.recovery``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.gpu_groups import assigned_gpu_ids, rank_runtime_env
from cluster.trainer.backend import build_backend
from cluster.worker_setup import lower_thread_priority

if TYPE_CHECKING:
    from cluster.trainer.config import TrainerConfig
    from lilo.backend.sharding.group import RankGroup
    from lilo.backend.sharding.plans import Plan

logger = logging.getLogger(__name__)

# How long rank 0 waits, after a failed pass, for its failures to reach the futures DB before it exits.
EXIT_AFTER_FAILURE_S = 2.0
def rendezvous_file(trainer: str) -> Path:
    """A fresh file for the group of ``trainer`` to meet at (its ranks share a node); its earlier groups' go."""
    directory = Path(tempfile.gettempdir()) / "lilo-rank-groups"
    directory.mkdir(exist_ok=True)
    for stale in directory.glob(f"{trainer}-*"):
        stale.unlink(missing_ok=True)
    return directory / f"{trainer}-{uuid.uuid4().hex}"


def rank_place(rank: int) -> dict[str, Any]:
    """Where this process, rank ``rank`` of its trainer, runs: its node, pid and GPUs (their ids, none on CPU)."""
    gpu_ids = assigned_gpu_ids()
    return {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
            "gpu": bool(gpu_ids), "gpu_ids": gpu_ids}


def rank_memory(backend: Any) -> dict[str, int]:
    """What a rank holds: its base weights' bytes (its shards and the replicated rest), its adapter slots' state
    (a follower's has no optimizer moments) and its peak so far (the device's peak allocation on CUDA; on the CPU
    the process's peak resident size)."""
    import resource

    import torch

    base = backend.sharded.local_bytes if backend.sharded else sum(  # the frozen ones: not the LoRA bank's views
        p.numel() * p.element_size() for p in backend.model.parameters() if not p.requires_grad)
    if backend.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(backend.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"base_bytes": base, "adapter_state_bytes": backend.slot_state_bytes(), "peak_bytes": peak}


@ray.remote(max_restarts=0, max_concurrency=8)
class RankActor:
    """Rank ``group.rank`` of trainer ``trainer``: joins the group, loads its shard, then runs rank 0's plans on one
    torch thread of its own."""

    def __init__(self, trainer: str, base_model: str, config: TrainerConfig, group: RankGroup) -> None:
        self._name = f"{trainer} rank {group.rank}"
        self._rank = group.rank
        self._torch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lilo-rank-torch")
        self._loading = self._torch.submit(self._load, trainer, base_model, config, group)

    def _load(self, trainer: str, base_model: str, config: TrainerConfig, group: RankGroup) -> Any:
        from lilo.backend.sharding.follower import Follower

        lower_thread_priority(config.compute_nice)
        return Follower(build_backend(trainer, base_model, config, group))

    async def ready(self) -> dict[str, Any]:
        """Waits for its shard to load; says where it runs and what it holds."""
        follower = await asyncio.wrap_future(self._loading)
        return {**rank_place(self._rank), **rank_memory(follower.backend)}

    async def alive(self) -> None:
        """Never returns: rank 0 holds this call open, and it fails the moment this process dies."""
        await asyncio.Event().wait()

    async def run(self, plan: Plan) -> Any:
        follower = await asyncio.wrap_future(self._loading)
        return await asyncio.get_running_loop().run_in_executor(self._torch, follower.run, plan)


class RankPeers:
    """Rank 0's followers (the backend's ``Peers``): started in the further bundles of rank 0's placement group."""

    def __init__(self, trainer: str, base_model: str, config: TrainerConfig, ranks: int, gpus: float) -> None:
        from lilo.backend.sharding.group import RankGroup

        self.trainer = trainer
        host = ray.util.get_node_ip_address()
        self.group = RankGroup(0, ranks, f"file://{rendezvous_file(trainer)}", host)
        placement: PlacementGroup | None = get_current_placement_group()
        if placement is None:
            raise RuntimeError(f"Trainer {trainer} has {ranks} ranks but runs in no placement group; start it with "
                               "cluster.trainer.actor.start_trainer.")
        self.actors = [
            RankActor.options(num_cpus=1, num_gpus=gpus, runtime_env=rank_runtime_env(gpus),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement, placement_group_bundle_index=rank)).remote(
                    trainer, base_model, config, RankGroup(rank, ranks, self.group.address, host))
            for rank in range(1, ranks)]
        self._broken: BaseException | None = None
        # Called once a pass failed: the trainer stops its engine, so nothing queued runs on the broken group.
        self.on_failure: Callable[[], None] = lambda: None

    def ready(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return ray.get([actor.ready.remote() for actor in self.actors], timeout=timeout_s)

    def watch(self) -> None:
        """Fail the group the moment a follower dies, whether a pass is under way or not: rank 0 may be deep in a
        pass's compute and meet the broken collective only at its end, well past the bound a client waits."""
        calls = [actor.alive.remote() for actor in self.actors]

        def wait_for_a_death() -> None:
            (ended,), _ = ray.wait(calls, num_returns=1, fetch_local=False)
            try:
                ray.get(ended)
            except Exception as error:
                self.failed(error)

        threading.Thread(target=wait_for_a_death, name="lilo-rank-watch", daemon=True).start()

    def dispatch(self, plans: Sequence[Plan]) -> list[ray.ObjectRef]:
        if self._broken is not None:
            raise RuntimeError(f"the rank group is being rebuilt after: {self._broken}")
        return [actor.run.remote(plan) for actor, plan in zip(self.actors, plans)]

    def collect(self, pending: list[ray.ObjectRef]) -> list[Any]:
        return ray.get(pending)

    def failed(self, error: BaseException) -> None:
        """Exit rank 0's process soon (the followers go with it): Ray restarts it, and it builds a fresh group."""
        if self._broken is not None:
            return
        self._broken = error
        logger.error("%s: a pass on its rank group failed (%s); restarting the group in %.0f s", self.trainer, error,
                     EXIT_AFTER_FAILURE_S)
        threading.Timer(EXIT_AFTER_FAILURE_S, os._exit, args=(1,)).start()
        self.on_failure()
