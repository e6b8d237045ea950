"""Unloading models, whoever asks: their client (``unload_model``), their session's close, or its expiry.

From the moment a model is marked unloaded its new requests are refused (410, saying why when lilo unloaded it
itself); its trainer frees the adapter slot once what the model queued before has run, and the unload's future
completes then. Its run and checkpoints stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Sequence

from ray.actor import ActorHandle

from cluster.placement import named_actor
from lilo.engine.commands import Kind
from lilo.errors import failure_category
from lilo.futures.store import Completion, Submission, unknown_model_error

logger = logging.getLogger(__name__)

# The seq a model's unload is recorded under, apart from its steps (1 on) and its creation (0): one unload per
# model, so a retried unload_model finds the first.
UNLOAD_SEQ = -1


@contextlib.asynccontextmanager
async def failing_future(futures: ActorHandle, request_id: int, kind: Kind) -> AsyncIterator[None]:
    """Whatever fails inside also fails the recorded future ``request_id`` (then raises on), so a future is never
    left pending by a step that did not happen."""
    try:
        yield
    except Exception as error:
        cause = getattr(error, "cause", None) or error
        await futures.complete.remote([Completion.failure(request_id, str(cause), failure_category(cause),
                                                          kind=kind)])
        raise


async def unload_model(futures: ActorHandle, model_id: str, tenant: str | None,
                       reason: str | None = None) -> dict[str, str]:
    """Unload one model of ``tenant`` (None: lilo itself), saying ``reason`` to its later requests when lilo
    unloads it; returns the unload's future (``request_id``, ``model_id``)."""
    trainer = await futures.trainer_of.remote(model_id, tenant)
    if trainer is None:
        raise unknown_model_error(model_id)
    outcome = await futures.submit_once.remote(
        Submission(model_id, Kind.UNLOAD_MODEL, {}, seq_id=UNLOAD_SEQ, tenant=tenant, trainer=trainer).prepared())
    if not outcome.duplicate:
        async with failing_future(futures, outcome.request_id, Kind.UNLOAD_MODEL):
            await futures.mark_unloaded.remote(model_id, reason)
            await named_actor(trainer).unload_future.remote(model_id, str(outcome.request_id))
    return {"request_id": str(outcome.request_id), "model_id": model_id}


async def unload_models(futures: ActorHandle, models: Sequence[tuple[str, str | None]], reason: str | None,
                        why: str) -> None:
    """Unload every ``(model_id, tenant)`` at once; one that cannot be unloaded now (being restored, say) is
    logged with ``why`` they were being unloaded and left as it is."""
    outcomes = await asyncio.gather(*(unload_model(futures, model_id, tenant, reason) for model_id, tenant in models),
                                    return_exceptions=True)
    for (model_id, _), outcome in zip(models, outcomes):
        if isinstance(outcome, BaseException):
            logger.warning("%s, but model %s was not unloaded: %s", why, model_id, outcome)
