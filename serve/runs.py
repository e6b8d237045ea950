"""Training runs and their checkpoints, as the SDK's RestClient (and the ``tinker`` CLI) reads them.

A training run is a model in the futures DB (an unloaded one stays a run). Its checkpoints are files the trainer
that owns the run wrote, so listing and deleting them is asked of that trainer (``TrainerActor.list_checkpoints``,
``delete_checkpoint``), never read from the ingress's disk: on a multi-node cluster the files are on the trainer's
node unless the checkpoint directory is shared storage (see ``lilo.backend.checkpoint_index``). Responses have the SDK's shapes: ``TrainingRun``,
``TrainingRunsResponse``, ``Checkpoint``, ``CheckpointsListResponse``.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any, Iterable, Sequence

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from lilo.backend.checkpoint_index import SAMPLER_WEIGHTS, WEIGHTS, CheckpointEntry
from cluster.placement import named_actor
from lilo.tenants import owner

CHECKPOINT_TYPES = {WEIGHTS: "training", SAMPLER_WEIGHTS: "sampler"}


def timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def checkpoint_json(checkpoint: CheckpointEntry) -> dict[str, Any]:
    """A checkpoint as the SDK's ``Checkpoint``."""
    return {"checkpoint_id": checkpoint.checkpoint_id, "checkpoint_type": CHECKPOINT_TYPES[checkpoint.kind],
            "time": timestamp(checkpoint.time_s), "tinker_path": checkpoint.tinker_path,
            "size_bytes": checkpoint.size_bytes, "public": False, "user_metadata": None, "expires_at": None}


def training_run_json(run: dict[str, Any], checkpoints: Iterable[CheckpointEntry]) -> dict[str, Any]:
    """A model row of the futures DB (with ``last_request_time``) and its checkpoints as the SDK's ``TrainingRun``."""
    newest = {}
    for checkpoint in sorted(checkpoints, key=lambda c: c.time_s):
        newest[checkpoint.kind] = checkpoint
    return {"training_run_id": run["model_id"], "base_model": run["base_model"],
            "model_owner": owner(run["tenant"]), "is_lora": True, "corrupted": False,
            "lora_rank": run["lora_config"].get("rank"), "last_request_time": timestamp(run["last_request_time"]),
            "last_checkpoint": checkpoint_json(newest[WEIGHTS]) if WEIGHTS in newest else None,
            "last_sampler_checkpoint": (checkpoint_json(newest[SAMPLER_WEIGHTS]) if SAMPLER_WEIGHTS in newest
                                        else None),
            "user_metadata": run["user_metadata"]}


async def ask_file_keeper(owner: str | None, trainers: Sequence[str], method: str, *args: Any) -> Any:
    """Call ``method`` on the trainer that owns a run (and wrote its files) or, when that one is gone (it died, or
    the cluster restarted with fewer trainers), on the first trainer there is, which sees the same files on one
    machine or on shared storage."""
    if owner is not None and owner != trainers[0]:
        try:
            return await getattr(named_actor(owner), method).remote(*args)
        except (ValueError, RayActorError):  # no actor by that name, or it died
            pass
    return await getattr(named_actor(trainers[0]), method).remote(*args)


async def checkpoints_of(runs: Iterable[dict[str, Any]], trainers: Sequence[str]) -> dict[str, list[CheckpointEntry]]:
    """The checkpoints of these runs (model rows), each asked of the trainer that keeps its files, all at once."""
    by_owner: dict[str | None, list[str]] = {}
    for run in runs:
        by_owner.setdefault(run["trainer"], []).append(run["model_id"])
    answers = await asyncio.gather(*(ask_file_keeper(owner, trainers, "list_checkpoints", owned)
                                     for owner, owned in by_owner.items()))
    return {run: found for answer in answers for run, found in answer.items()}


# Each takes the caller's tenant: another tenant's runs are not listed, and answer 404 like unknown ones.
async def list_training_runs(futures: ActorHandle, trainers: Sequence[str], limit: int, offset: int,
                             tenant: str) -> dict[str, Any]:
    runs, total = await futures.training_runs.remote(limit, offset, tenant)
    checkpoints = await checkpoints_of(runs, trainers)
    return {"training_runs": [training_run_json(run, checkpoints.get(run["model_id"], [])) for run in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def get_training_run(futures: ActorHandle, trainers: Sequence[str], run_id: str, tenant: str) -> dict[str, Any]:
    run = await futures.training_run.remote(run_id, tenant)
    return training_run_json(run, (await checkpoints_of([run], trainers)).get(run_id, []))


async def list_checkpoints(futures: ActorHandle, trainers: Sequence[str], run_id: str, tenant: str) -> dict[str, Any]:
    run = await futures.training_run.remote(run_id, tenant)
    checkpoints = (await checkpoints_of([run], trainers)).get(run_id, [])
    return {"checkpoints": [checkpoint_json(checkpoint) for checkpoint in checkpoints], "cursor": None}


async def list_user_checkpoints(futures: ActorHandle, trainers: Sequence[str], limit: int, offset: int,
                                tenant: str) -> dict[str, Any]:
    """Every one of the tenant's runs' checkpoints, newest first, one page of them."""
    runs, _ = await futures.training_runs.remote(None, 0, tenant)
    checkpoints = await checkpoints_of(runs, trainers)
    newest_first = sorted((c for found in checkpoints.values() for c in found), key=lambda c: -c.time_s)
    return {"checkpoints": [checkpoint_json(c) for c in newest_first[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(newest_first)}}


async def delete_checkpoint(futures: ActorHandle, trainers: Sequence[str], run_id: str, checkpoint_id: str,
                            tenant: str) -> None:
    run = await futures.training_run.remote(run_id, tenant)
    await ask_file_keeper(run["trainer"], trainers, "delete_checkpoint", run_id, checkpoint_id)
