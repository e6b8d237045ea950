"""Deleting checkpoints whose TTL has passed.

Expiry is enforced in two places, for two reasons: every request that names a checkpoint checks its expiry (the
futures DB's ``readable_checkpoint``), so an expired checkpoint is refused (410) and left out of listings from the
very second it expires; and this sweep, which the recovery actor runs every ``SWEEP_EVERY_S``, deletes the files, so
the disk is freed even when nobody asks for the checkpoint again. It runs in the recovery actor because that actor
already does lilo's own housekeeping (unloading idle sessions' models) and calls the trainers; the futures DB actor
stays a database writer that calls nobody.
"""

from __future__ import annotations

import logging
from typing import Sequence

from ray.actor import ActorHandle

from cluster.placement import ask_file_keeper
from lilo.backend.checkpoints.index import checkpoint_path_parts
from lilo.errors import NotFoundError

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 60.0


async def sweep_expired_checkpoints(futures: ActorHandle, trainers: Sequence[str]) -> list[str]:
    """Delete every expired checkpoint's files (each on the trainer that keeps its run's files) and mark it deleted;
    returns the tinker paths deleted. One that fails to delete is tried again on the next sweep."""
    deleted = []
    for record, trainer in await futures.expired_checkpoints.remote():
        run, checkpoint_id = checkpoint_path_parts(record.tinker_path)
        try:
            await ask_file_keeper(trainer, trainers, "delete_checkpoint", run, checkpoint_id)
        except NotFoundError:
            pass  # its files were gone already (deleted by hand, or never written)
        except Exception:
            logger.exception("deleting the expired checkpoint %s failed; trying again later", record.tinker_path)
            continue
        deleted.append(record.tinker_path)
    if deleted:
        await futures.mark_checkpoints_deleted.remote(deleted)
        logger.info("deleted %d checkpoint(s) past their TTL", len(deleted))
    return deleted
