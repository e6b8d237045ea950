"""The actors the control plane calls, in one value every part of it holds."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Mapping, Sequence

from ray.actor import ActorHandle

from cluster.placement import ask_file_keeper, choose_trainer, free_slots, models_placed, named_actor, trainer_facts
from cluster.reconciler import REGISTRY_REFRESH_S, TrainerDirectory
from lilo.errors import NotFoundError, SaturatedError, UnavailableError

# Following the GPUs, a trainer that does not say what it serves within this time is passed over when placing (its
# node may have just left); with a fixed set of trainers placement waits for each, as it always did.
ANSWER_WITHIN_S = 5.0


def starting_message(base_model: str, registry: Mapping[str, Any]) -> str:
    return (f"No trainer serves {base_model!r} yet: trainers are starting as the cluster's GPU nodes join "
            f"({registry['gpus']} GPU(s) so far, {registry['starting']} trainer(s) starting). Retry in a minute; "
            "the SDK retries this by itself.")


@dataclasses.dataclass(frozen=True)
class Actors:
    """The futures DB actor, and lilo's trainer actors by name, as the trainer registry lists them."""

    futures: ActorHandle
    directory: TrainerDirectory
    # Following the GPUs: how long a placement that found every trainer full waits for the trainer it asked for.
    trainer_wait_s: float = 0.0

    def trainer(self, name: str) -> ActorHandle:
        return named_actor(name)

    async def trainers(self) -> Sequence[str]:
        """The ready trainers (the registry, at most REGISTRY_REFRESH_S old)."""
        return await self.directory.names()

    async def place(self, base_model: str, tenant: str) -> str:
        """A trainer for a new model of ``base_model`` (of ``tenant``, whose models it spreads): the least loaded with
        a free slot (cluster.placement). When every one is full, a 429; following the GPUs, one more trainer is asked
        for first and waited for up to ``trainer_wait_s``, and while none serves the base model yet (they are
        starting) a 503."""
        deadline = time.monotonic() + self.trainer_wait_s
        while True:
            registry = await self.directory.registry()
            follow = registry["follow_gpus"]
            facts = await trainer_facts(registry["trainers"], ANSWER_WITHIN_S if follow else None)
            slots = free_slots(facts, base_model)
            try:
                placed, of_tenant = await asyncio.gather(models_placed(self.futures),
                                                         models_placed(self.futures, tenant))
                return choose_trainer(slots, placed, of_tenant)
            except SaturatedError as full:
                if not follow:
                    raise
                coming = await self.directory.request_trainer(base_model)
                if not slots:
                    raise UnavailableError(starting_message(base_model, registry)) from None
                if not coming:
                    raise SaturatedError(f"{full} No more trainers may be added (the cluster is at --max-trainers)."
                                         ) from None
                if time.monotonic() >= deadline:
                    raise SaturatedError(f"{full} One more trainer was asked for and was not ready within "
                                         f"{self.trainer_wait_s:.0f} s (a new GPU node takes minutes).") from None
            await asyncio.sleep(REGISTRY_REFRESH_S)

    async def readable_run(self, path: str, tenant: str, unknown: str) -> dict[str, Any]:
        """The training run (model row) that saved the checkpoint ``path`` when ``tenant`` may read it (one of its
        own, or a published one; 410 once it expired); else a 404 saying ``unknown``."""
        try:
            return (await self.futures.readable_checkpoint.remote(path, tenant))[0]
        except NotFoundError:
            raise NotFoundError(unknown) from None

    async def ask_file_keeper(self, trainer: str | None, method: str, *args: Any) -> Any:
        """``method`` of the trainer that keeps a run's files, or of the first one when that trainer is gone."""
        return await ask_file_keeper(trainer, await self.trainers(), method, *args)
