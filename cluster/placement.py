"""Which trainer a new model goes to, and which one a sampling session samples on: the choices are pure
functions; ``trainer_facts`` and ``models_placed`` ask the trainers and the futures DB what they need
(``serve.tinker.actors.Actors.place`` puts them together)."""

from __future__ import annotations

import asyncio
import functools
import zlib
from typing import Any, Mapping, Sequence

import ray
from ray.actor import ActorHandle

from cluster.local import NAMESPACE
from lilo.backend.paging.policy import Room
from lilo.errors import InvalidRequestError, SaturatedError, UnavailableError


@functools.lru_cache(maxsize=None)
def named_actor(name: str) -> ActorHandle:
    """A handle to one of lilo's named actors, looked up once per process: each lookup is a blocking GCS round
    trip, which would stall an event loop on every request. (A restarted actor keeps its handle.)"""
    return ray.get_actor(name, namespace=NAMESPACE)


async def ask_file_keeper(trainer: str | None, trainers: Sequence[str], method: str, *args: Any) -> Any:
    """Call ``method`` on ``trainer``, the trainer of a run (which wrote its checkpoint files) or, when that one is
    gone (it died, or the cluster restarted with fewer trainers), on the first trainer there is, which sees the same
    files on one machine or on shared storage."""
    if not trainers:
        raise UnavailableError("No trainer is ready yet (they are starting as the cluster's GPU nodes join); retry "
                               "in a minute.")
    if trainer is not None and trainer != trainers[0]:
        try:
            return await getattr(named_actor(trainer), method).remote(*args)
        except (ValueError, ray.exceptions.RayActorError):  # no actor by that name, or it died
            pass
    return await getattr(named_actor(trainers[0]), method).remote(*args)


async def trainer_facts(trainers: Sequence[str], answer_within_s: float | None = None) -> dict[str, dict]:
    """What each trainer says it serves (``TrainerActor.ready``). With ``answer_within_s``, a trainer that does not
    answer within that time (dead, restarting, still loading) is left out instead of waited for."""
    async def ask(name: str) -> dict | None:
        try:
            return await asyncio.wait_for(named_actor(name).ready.remote(), answer_within_s)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            if answer_within_s is None:
                raise
            return None

    answers = await asyncio.gather(*(ask(name) for name in trainers))
    return {info["name"]: info for info in answers if info is not None}


async def models_placed(futures: ActorHandle, tenant: str | None = None) -> dict[str, int]:
    """How many models each trainer holds (only ``tenant``'s when given), per the futures DB's placement."""
    placed: dict[str, int] = {}
    for trainer in (await futures.placement.remote(tenant)).values():
        if trainer is not None:
            placed[trainer] = placed.get(trainer, 0) + 1
    return placed


def free_slots(facts: Mapping[str, dict], base_model: str) -> dict[str, Room]:
    """The room, per tier (``TrainerActor.ready``'s ``room``), of each trainer a model of ``base_model`` may go to:
    those serving it, and of those only the ones holding a GPU once any does. A CPU trainer (started before any
    GPU node joined the cluster) keeps training the models it holds, takes no new one, and is let go once idle
    (``cluster.scaling.trainers_to_release``)."""
    serving = {name: info for name, info in facts.items() if info["base_model"] == base_model}
    if any(info["gpu"] for info in serving.values()):
        serving = {name: info for name, info in serving.items() if info["gpu"]}
    return {name: Room(**info["room"]) for name, info in serving.items()}


def choose_trainer(room: Mapping[str, Room], models_placed: Mapping[str, int],
                   tenant_placed: Mapping[str, int] | None = None) -> str:
    """The trainer with the most room for a new model: one with a free device slot first (a model there trains
    without paging anyone out), then one with host-memory room (whom it pushes out comes back with a copy, not a
    file read), then disk room; within that, the fewest models of the new model's tenant (``tenant_placed``: so a
    tenant's models spread over the trainers and its share of each busy one adds up), then the most room in those
    tiers in that order; ties go to the fewest models, then the lowest name (repeatable). Not the sum over tiers: a
    trainer's disk holds hundreds of models, so a sum would send every new model to the trainer with the largest
    disk while another's slots stand empty. A trainer is full when every tier is."""
    candidates = [name for name, free in room.items() if free.total > 0]
    if not candidates:
        raise SaturatedError(
            f"Every trainer is full ({len(room)} trainer(s), no free adapter slot nor room to page one out); unload "
            "a model or retry later.")
    tenant_placed = tenant_placed or {}

    def preference(name: str) -> tuple:
        free = room[name]
        tier = 0 if free.device > 0 else 1 if free.host > 0 else 2
        return (tier, tenant_placed.get(name, 0), -free.device, -free.host, -free.disk, models_placed.get(name, 0),
                name)

    return min(candidates, key=preference)


def choose_sampling_trainer(sampling_session_id: str, base_model: str, served: Mapping[str, str],
                            checkpoint_trainer: str | None = None) -> str:
    """The trainer that samples for a session: ``checkpoint_trainer`` (the trainer of the training run whose
    checkpoint it samples, which wrote that checkpoint) when it serves the base model, else one of the trainers
    serving it, picked by the session id (so a session's samples stay on one trainer and sessions spread over the
    trainers). ``served``: trainer -> its base model."""
    if checkpoint_trainer is not None and served.get(checkpoint_trainer) == base_model:
        return checkpoint_trainer
    candidates = sorted(name for name, model in served.items() if model == base_model)
    if not candidates:
        raise InvalidRequestError(f"No trainer serves base model {base_model!r}; "
                                  f"sample from one of {', '.join(sorted(set(served.values())))}.")
    return candidates[zlib.crc32(sampling_session_id.encode()) % len(candidates)]
