"""The GPUs and placement groups a sharded trainer's ranks and the vLLM sampler beside them share: the ids Ray gave a
process, which GPU torch calls its own, the group's name and bundles. Both the trainer (``cluster.trainer``) and the
sampling plane (``cluster.sampling``) import this; it imports neither."""

from __future__ import annotations

from typing import Any, Sequence

import ray

# A sharded trainer's ranks see every GPU of their node, as Ray Train's torch workers do: NCCL on NVSwitch machines
# mishandles ranks whose visible devices do not overlap (docs/design.md). Each rank then picks its own GPU by the
# id Ray gave it (``own_gpu_index``).
SHARED_GPUS_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def rank_runtime_env(gpus: float) -> dict[str, Any] | None:
    """The runtime environment of a rank of a sharded trainer that has ``gpus`` GPU: its node's GPUs all visible;
    without GPUs, None (the job's own, as for any actor)."""
    return {"env_vars": SHARED_GPUS_ENV} if gpus else None


def assigned_gpu_ids() -> list[str]:
    """The ids of the GPUs Ray gave this process (none on CPU)."""
    return [str(gpu) for gpu in ray.get_gpu_ids()]


def own_gpu_index(gpu_ids: Sequence[str], visible: str | None) -> int:
    """This process's GPU as torch numbers it: Ray's id of it (``gpu_ids``, one) among the devices it sees
    (``CUDA_VISIBLE_DEVICES``: all of the node's when unset, or the node's own list, whose entries Ray's ids are)."""
    if len(gpu_ids) != 1:
        raise RuntimeError(f"A rank of a sharded trainer holds one GPU; Ray gave this one {list(gpu_ids)}.")
    listed = [device.strip() for device in visible.split(",")] if visible else None
    if listed is None:
        return int(gpu_ids[0])
    if gpu_ids[0] not in listed:
        raise RuntimeError(f"GPU {gpu_ids[0]} is not among this process's CUDA_VISIBLE_DEVICES ({visible}).")
    return listed.index(gpu_ids[0])


def rank_group_name(trainer: str) -> str:
    """The name of a sharded trainer's placement group (detached, like the trainer)."""
    return f"{trainer}-ranks"


def rank_bundles(ranks: int, gpus: float) -> list[dict[str, float]]:
    """The placement group bundles of a trainer of ``ranks`` ranks whose ranks take ``gpus`` GPU each: one CPU and
    a whole GPU each (where a rank takes less, a vLLM sampler beside the group has the rest of every bundle's GPU,
    ``cluster.sampling.actor.group_gpu_ids``); without GPUs, one CPU."""
    return [{"CPU": 1.0, **({"GPU": 1.0} if gpus else {})} for _ in range(ranks)]
