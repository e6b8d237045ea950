"""``GET /api/v1/console/overview``: everything the console page (``/console``) shows, in one answer, for the caller's
tenant, or for every tenant when the tenants file marks the caller admin.

- models: each run's state, base model, rank, trainer and slot tier (``device`` / ``host`` / ``disk``, from its
  trainer's ``residency``), and its critical path as one stacked bar (``critical_path_bar``);
- trainers: the reconciler's view (``ReconcilerActor.status``, as ``lilo status`` prints it) with each one's slots
  and room per tier; a tenant sees how many models a trainer holds, and the ids of its own only;
- checkpoints (with their TTL and size) and sessions.

Each model's bar covers the interval since this ``reader`` last asked (a reader that never asked: everything since
its trainer started), so a page polling with one reader name of its own gets one interval per poll; the page keeps
the recent ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable, Mapping, Sequence

import ray

from cluster.placement import named_actor
from cluster.reconciler import RECONCILER_ACTOR_NAME
from lilo.tenants import tenant_of
from serve.tinker.actors import Actors
from serve.tinker.runs import Runs, checkpoint_json, timestamp
from serve.tinker.sessions import summary_json

# The newest runs and sessions one overview lists.
MAX_RUNS = 200
MAX_SESSIONS = 100
# How long the overview waits for one trainer's (or the reconciler's) answer before leaving it out.
ANSWER_WITHIN_S = 3.0
# The stacked bar's segments, in order: each sums the phases (``lilo.timing.critical_path``) ending in its suffixes.
SEGMENTS: dict[str, tuple[str, ...]] = {
    "execute": (".execute",),
    "wait_self": (".queue_wait_self",),
    "wait_others": (".queue_wait_others",),
    "wait_idle": (".queue_wait_idle",),
    "coalesce": (".coalesce_wait",),
    "capture": (".capture",),
    "persist": (".persist",),
    "page_in": (".page_in", ".page_out"),  # paging the model in, and another out to make its slot
}
# What a tenant that is not admin sees of a trainer (never the samplers' loaded adapters: other tenants' paths).
TRAINER_FIELDS = ("name", "base_model", "state", "gpu", "ranks", "node_id", "node_ip", "models", "free_slots")


def critical_path_bar(phases: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """One model's critical path over an interval as the console's bar: seconds per segment, the steps
    (forward_backward executions) and commands it covers, and the mean batch of its executions."""
    seconds = {segment: round(sum(stats["total_s"] for phase, stats in phases.items()
                                  if phase.endswith(suffixes)), 6)
               for segment, suffixes in SEGMENTS.items()}
    executions = [stats for phase, stats in phases.items() if phase.endswith(".execute")]
    commands = sum(stats["count"] for stats in executions)
    batch = sum(stats["mean_batch"] * stats["count"] for stats in executions)
    return {"seconds": seconds, "steps": phases.get("forward_backward.execute", {}).get("count", 0),
            "commands": commands, "mean_batch": round(batch / commands, 3) if commands else None}


def model_state(run: Mapping[str, Any]) -> str:
    """``unloaded``, ``placing`` (recorded, no trainer holds it: being created or restored) or ``loaded``."""
    if run["unloaded_at"] is not None:
        return "unloaded"
    return "placing" if run["trainer"] is None else "loaded"


def trainer_view(trainer: Mapping[str, Any], residency: Mapping[str, Any] | None, visible: set[str],
                 admin: bool) -> dict[str, Any]:
    """One trainer as the console shows it: ``TRAINER_FIELDS``, its slots and room per tier, and the ids of the models
    it holds that the caller may see (``visible``: the caller's, or with ``admin`` every one, with samplers too)."""
    view = dict(trainer) if admin else {field: trainer.get(field) for field in TRAINER_FIELDS}
    held = sorted((residency or {}).get("tiers", {}))
    view.update(slots=(residency or {}).get("slots"), room=(residency or {}).get("room"),
                model_ids=[model_id for model_id in held if admin or model_id in visible])
    return view


def by_tier(residencies: Iterable[Mapping[str, Any] | None]) -> dict[str, str]:
    """model_id -> its tier, over every trainer's residency."""
    return {model_id: tier for residency in residencies
            for model_id, tier in (residency or {}).get("tiers", {}).items()}


class ConsoleOverview:
    def __init__(self, actors: Actors, runs: Runs) -> None:
        self._futures = actors.futures
        self._runs = runs

    async def overview(self, tenant: str, reader: str) -> dict[str, Any]:
        admin = await self._futures.is_admin.remote(tenant)
        scope = None if admin else tenant  # None: lilo itself, which sees every tenant's records
        (runs, total), sessions, placement, status = await asyncio.gather(
            self._futures.training_runs.remote(MAX_RUNS, 0, scope),
            self._futures.search_sessions.remote(scope, {}, MAX_SESSIONS, None),
            self._futures.placement.remote(scope), _answer(named_actor(RECONCILER_ACTOR_NAME).status.remote()))
        names = [t["name"] for t in (status or {}).get("trainers", []) if t["state"] in ("ready", "idle")]
        loaded = [run for run in runs if model_state(run) == "loaded"]
        # Timing is asked under this tenant's own reader names, as GET /api/v1/timing does (serve.tinker.timing);
        # without one, the default reader's view (since the trainer started), which no reset changes.
        reader_name = f"{tenant}/console/{reader}" if reader else ""
        residencies, bars, checkpoints, session_runs = await asyncio.gather(
            asyncio.gather(*(_answer(named_actor(name).residency.remote()) for name in names)),
            asyncio.gather(*(_answer(named_actor(run["trainer"]).timing.remote(run["model_id"], bool(reader),
                                                                                 reader_name))
                             for run in loaded)),
            self._runs.checkpoints_of(runs),
            self._futures.session_runs.remote([row.session_id for row in sessions[0]]))
        tiers, residency_of = by_tier(residencies), dict(zip(names, residencies))
        timing = {run["model_id"]: critical_path_bar(bar["phases"]) for run, bar in zip(loaded, bars)
                  if bar is not None}
        return {
            "tenant": tenant, "admin": admin, "models_total": total,
            "models": [model_json(run, tiers.get(run["model_id"]), timing.get(run["model_id"])) for run in runs],
            "trainers": None if status is None else [
                trainer_view(trainer, residency_of.get(trainer["name"]), set(placement), admin)
                for trainer in status["trainers"]],
            "checkpoints": sorted(({**checkpoint_json(listed), "model_id": run_id} for run_id, found in
                                   checkpoints.items() for listed in found), key=lambda c: c["time"], reverse=True),
            "sessions": sessions_json(sessions[0], session_runs, checkpoints),
        }


def model_json(run: Mapping[str, Any], tier: str | None, bar: dict[str, Any] | None) -> dict[str, Any]:
    return {"model_id": run["model_id"], "tenant": tenant_of(run["tenant"]), "base_model": run["base_model"],
            "rank": run["lora_config"].get("rank"), "state": model_state(run), "trainer": run["trainer"],
            "tier": tier, "session_id": run["session_id"], "created": timestamp(run["created_at"]),
            "last_request": timestamp(run["last_request_time"]), "unloaded_reason": run["unloaded_reason"],
            "critical_path": bar}


def sessions_json(rows: Sequence[Any], runs: Mapping[str, list[dict]], checkpoints: Mapping[str, list]) -> list[dict]:
    now = time.time()
    out = []
    for row in rows:
        held = [listed for run in runs.get(row.session_id, []) for listed in checkpoints.get(run["model_id"], [])]
        out.append({**summary_json(row, now, len(held), sum(entry.size_bytes for entry, _ in held)),
                    "models": len(runs.get(row.session_id, []))})
    return out


async def _answer(call: Any) -> Any:
    """An actor's answer, or None when it did not come within ANSWER_WITHIN_S (dead, restarting, busy)."""
    try:
        return await asyncio.wait_for(call, ANSWER_WITHIN_S)
    except (asyncio.TimeoutError, ray.exceptions.RayActorError):
        return None
