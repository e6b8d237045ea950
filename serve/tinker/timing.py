"""``GET /api/v1/timing``: the critical path of one of the caller's models, or the cluster's."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import HTTPException
from ray.exceptions import RayActorError

from cluster.timing import get_timing_actor
from lilo.backend.checkpoints.paths import TINKER_SCHEME, parse_tinker_path
from lilo.errors import InvalidRequestError
from lilo.timing.phase_stats import ALL_MODELS
from serve.tinker.actors import Actors


def timing_record(model_id: str) -> str | None:
    """The record whose tenant owns timing under ``model_id``: a model or sampling session of that id, or for a
    sampler checkpoint's path (how samples through it are timed) the model that saved it; None: no record can."""
    if not model_id.startswith(TINKER_SCHEME):
        return model_id
    try:
        return parse_tinker_path(model_id)[0]
    except InvalidRequestError:
        return None


class Timing:
    def __init__(self, actors: Actors) -> None:
        self._actors = actors
        self._timing = get_timing_actor()

    async def snapshot(self, model_id: str | None, reset: bool, reader: str, tenant: str) -> dict[str, Any]:
        """Critical path of one of the caller's models (queue wait vs execute vs capture/persist, batch sharing), or
        the cluster's, summed over every model (no model ids in it); 404 for a model without timing."""
        # Readers are per tenant: one tenant's reset never takes another's interval (nor lilo's own readers').
        snapshot = await self._snapshot(model_id, reset, f"{tenant}/{reader}", tenant)
        if snapshot is None:
            raise HTTPException(
                status_code=404,
                detail=f"Unknown model_id {model_id!r}: no trainer has reported timing for it. "
                "Pass the model_id that create_model returned, or leave model_id out for the cluster-wide view.",
            )
        return snapshot

    async def known(self, model_id: str, reader: str, tenant: str) -> dict[str, Any] | None:
        """``snapshot`` of one of the caller's models, read without a reset; None where there is no timing."""
        return await self._snapshot(model_id, False, f"{tenant}/{reader}", tenant)

    async def _snapshot(self, model_id: str | None, reset: bool, reader: str, tenant: str) -> dict[str, Any] | None:
        """A placed model's timing comes fresh from the trainer that holds it; everything else (the cluster view, a
        model no trainer holds any more) from the timing actor's merged view. Another tenant's model is one without
        timing."""
        if model_id == ALL_MODELS:
            model_id = None
        if model_id is not None:
            record = timing_record(model_id)
            record_tenant, trainer = (await self._actors.futures.tenant_and_trainer_of.remote(record) if record
                                      else (None, None))
            if record_tenant != tenant:
                return None
            if trainer is not None:
                with contextlib.suppress(RayActorError):  # its trainer is restarting: the merged view has it
                    snapshot = await self._actors.trainer(trainer).timing.remote(model_id, reset, reader)
                    if snapshot is not None:
                        return snapshot
        try:
            return await self._timing.snapshot.remote(model_id, reset, reader)
        except RayActorError:
            # The detached actor was restarted or re-created: look it up again by name, once.
            self._timing = get_timing_actor()
            return await self._timing.snapshot.remote(model_id, reset, reader)
