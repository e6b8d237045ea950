"""The actors the control plane calls, in one value every part of it holds."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.actor import ActorHandle

from cluster.placement import ask_file_keeper, named_actor, place
from lilo.errors import NotFoundError


@dataclasses.dataclass(frozen=True)
class Actors:
    """The futures DB actor, and lilo's trainer actors by name."""

    futures: ActorHandle
    trainers: tuple[str, ...]

    def trainer(self, name: str) -> ActorHandle:
        return named_actor(name)

    async def place(self, base_model: str) -> str:
        """A trainer for a new model of ``base_model`` (cluster.placement.place; 429 when every one is full)."""
        return await place(self.futures, self.trainers, base_model)

    async def readable_run(self, path: str, tenant: str, unknown: str) -> dict[str, Any]:
        """The training run (model row) that saved the checkpoint ``path`` when ``tenant`` may read it (one of its
        own, or a published one; 410 once it expired); else a 404 saying ``unknown``."""
        try:
            return (await self.futures.readable_checkpoint.remote(path, tenant))[0]
        except NotFoundError:
            raise NotFoundError(unknown) from None

    async def ask_file_keeper(self, trainer: str | None, method: str, *args: Any) -> Any:
        """``method`` of the trainer that keeps a run's files, or of the first one when that trainer is gone."""
        return await ask_file_keeper(trainer, self.trainers, method, *args)
