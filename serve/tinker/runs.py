"""Training runs and their checkpoints, as the SDK's RestClient (and the ``tinker`` CLI) reads them.

A training run is a model in the futures DB (an unloaded one stays a run). Its checkpoints are files the trainer
of the run wrote, so listing and deleting them is asked of that trainer (``TrainerActor.list_checkpoints``,
``delete_checkpoint``), never read from the ingress's disk: on a multi-node cluster the files are on the trainer's
node unless the checkpoint directory is shared storage (see ``lilo.backend.checkpoints.index``). What the futures DB
records of each (its expiry, whether it is public: ``lilo.futures.checkpoint_records``) is joined in, and a
checkpoint past its TTL is left out even before the expiry sweep deletes its files. Responses have the SDK's shapes:
``TrainingRun``, ``TrainingRunsResponse``, ``Checkpoint``, ``CheckpointsListResponse``.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Iterable

from ray.exceptions import RayActorError

from cluster.usage import TRAINER_ANSWER_S, merge_usage
from lilo.backend.checkpoints.index import (
    EXTERNAL_WEIGHTS, SAMPLER_WEIGHTS, WEIGHTS, CheckpointEntry, checkpoint_path,
)
from lilo.futures.checkpoint_records import CheckpointRecord
from lilo.session_search import user_urn
from lilo.tenants import tenant_of
from serve.tinker.actors import Actors

CHECKPOINT_TYPES = {WEIGHTS: "training", SAMPLER_WEIGHTS: "sampler", EXTERNAL_WEIGHTS: "external"}
# A checkpoint's files and what the futures DB records of it (None: nothing, so private and never expiring).
Listed = tuple[CheckpointEntry, CheckpointRecord | None]


def timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def checkpoint_json(listed: Listed) -> dict[str, Any]:
    """A checkpoint as the SDK's ``Checkpoint``."""
    checkpoint, record = listed
    expires_at = None if record is None or record.expires_at is None else timestamp(record.expires_at)
    return {"checkpoint_id": checkpoint.checkpoint_id, "checkpoint_type": CHECKPOINT_TYPES[checkpoint.kind],
            "time": timestamp(checkpoint.time_s), "tinker_path": checkpoint.tinker_path,
            "size_bytes": checkpoint.size_bytes, "public": record is not None and record.public,
            "user_metadata": None, "expires_at": expires_at}


def unexpired(entries: Iterable[CheckpointEntry], records: dict[str, CheckpointRecord], now: float) -> list[Listed]:
    """Each checkpoint with its record, leaving out those past their TTL (their files may not be deleted yet)."""
    listed = [(entry, records.get(entry.tinker_path)) for entry in entries]
    return [(entry, record) for entry, record in listed if record is None or not record.expired(now)]


def training_run_json(run: dict[str, Any], checkpoints: Iterable[Listed]) -> dict[str, Any]:
    """A model row of the futures DB (with ``last_request_time``) and its checkpoints as the SDK's ``TrainingRun``."""
    newest = {}
    for checkpoint in sorted(checkpoints, key=lambda listed: listed[0].time_s):
        newest[checkpoint[0].kind] = checkpoint
    return {"training_run_id": run["model_id"], "base_model": run["base_model"],
            "model_owner": tenant_of(run["tenant"]), "is_lora": True, "corrupted": False,
            "lora_rank": run["lora_config"].get("rank"), "last_request_time": timestamp(run["last_request_time"]),
            "last_checkpoint": checkpoint_json(newest[WEIGHTS]) if WEIGHTS in newest else None,
            "last_sampler_checkpoint": (checkpoint_json(newest[SAMPLER_WEIGHTS]) if SAMPLER_WEIGHTS in newest
                                        else None),
            "user_metadata": run["user_metadata"]}


class Runs:
    """The caller's training runs and their checkpoints: another tenant's runs are not listed, and answer 404 like
    unknown ones."""

    def __init__(self, actors: Actors) -> None:
        self._actors = actors
        self._futures = actors.futures

    async def usage(self, tenant: str) -> dict[str, Any]:
        """The caller's usage (``GET /api/v1/usage``): tokens trained and sampled and requests since the service's
        futures file was made, its share of the trainers' execute seconds (since each started), models held,
        requests in flight, checkpoint bytes (measured now), and the limits the tenants file gives it."""
        trainers = await self._actors.trainers()

        async def share_of(name: str) -> dict | None:
            try:
                return await asyncio.wait_for(self._actors.trainer(name).tenant_usage.remote(), TRAINER_ANSWER_S)
            except (asyncio.TimeoutError, RayActorError):
                return None

        counted, storage, *shares = await asyncio.gather(
            self._futures.usage.remote(tenant), self.storage_bytes(tenant), *(share_of(name) for name in trainers))
        return {"tenant": tenant, **merge_usage(counted, shares, tenant)[tenant], "storage_bytes": storage}

    async def storage_bytes(self, tenant: str) -> int:
        """The bytes of ``tenant``'s unexpired checkpoints, measured now (its ``storage_gb`` limit's use)."""
        return (await self._held(tenant))[1]

    async def _held(self, tenant: str) -> tuple[int, int]:
        """How many unexpired checkpoints ``tenant`` holds, and their bytes."""
        runs, _ = await self._futures.training_runs.remote(None, 0, tenant)
        held = [listed for found in (await self.checkpoints_of(runs)).values() for listed in found]
        return len(held), sum(entry.size_bytes for entry, _ in held)

    async def checkpoints_of(self, runs: Iterable[dict[str, Any]]) -> dict[str, list[Listed]]:
        """The unexpired checkpoints of these runs (model rows), each asked of the trainer that keeps its files, all
        at once, with their records."""
        by_trainer: dict[str | None, list[str]] = {}
        for run in runs:
            by_trainer.setdefault(run["trainer"], []).append(run["model_id"])
        run_ids = [run_id for of_trainer in by_trainer.values() for run_id in of_trainer]
        records, *answers = await asyncio.gather(
            self._futures.checkpoint_records.remote(run_ids),
            *(self._actors.ask_file_keeper(trainer, "list_checkpoints", of_trainer)
              for trainer, of_trainer in by_trainer.items()))
        now = time.time()
        return {run: unexpired(found, records, now) for answer in answers for run, found in answer.items()}

    async def training_runs(self, limit: int, offset: int, tenant: str) -> dict[str, Any]:
        runs, total = await self._futures.training_runs.remote(limit, offset, tenant)
        checkpoints = await self.checkpoints_of(runs)
        return {"training_runs": [training_run_json(run, checkpoints.get(run["model_id"], [])) for run in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    async def training_run(self, run_id: str, tenant: str) -> dict[str, Any]:
        run = await self._futures.training_run.remote(run_id, tenant)
        return training_run_json(run, (await self.checkpoints_of([run])).get(run_id, []))

    async def checkpoints(self, run_id: str, tenant: str) -> dict[str, Any]:
        run = await self._futures.training_run.remote(run_id, tenant)
        checkpoints = (await self.checkpoints_of([run])).get(run_id, [])
        return {"checkpoints": [checkpoint_json(checkpoint) for checkpoint in checkpoints], "cursor": None}

    async def user_checkpoints(self, limit: int, offset: int, tenant: str) -> dict[str, Any]:
        """Every one of the tenant's runs' checkpoints, newest first, one page of them."""
        runs, _ = await self._futures.training_runs.remote(None, 0, tenant)
        checkpoints = await self.checkpoints_of(runs)
        newest_first = sorted((c for found in checkpoints.values() for c in found), key=lambda c: -c[0].time_s)
        return {"checkpoints": [checkpoint_json(c) for c in newest_first[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(newest_first)}}

    async def delete_checkpoint(self, run_id: str, checkpoint_id: str, tenant: str) -> None:
        """Delete one of the tenant's checkpoints (410 once past its TTL: the expiry sweep deletes it) and what the
        futures DB records of it."""
        run = await self._futures.training_run.remote(run_id, tenant)
        path = checkpoint_path(run_id, checkpoint_id)
        await self._futures.readable_checkpoint.remote(path, tenant, write=True)
        await self._actors.ask_file_keeper(run["trainer"], "delete_checkpoint", run_id, checkpoint_id)
        await self._futures.forget_checkpoint.remote(path)

    async def storage_usage(self, tenant: str) -> dict[str, Any]:
        """The SDK's ``CurrentCheckpointStorageUsageResponse`` for the caller: its unexpired checkpoints' count and
        bytes, measured now, as one row (lilo has no projects, and puts no price on storage)."""
        count, size = await self._held(tenant)
        return {"effective_rate_usd_per_gigabyte_month": None,
                "data": [{"project_id": None, "org_user_urn": user_urn(tenant), "checkpoint_count": count,
                          "size_bytes": size, "size_gigabytes": size / 1e9, "estimated_monthly_cost_usd": None}]}
