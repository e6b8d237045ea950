"""Which trainer a new model goes to, and which one a sampling session samples on: pure functions."""

from __future__ import annotations

import zlib
from typing import Mapping

from lilo.errors import InvalidRequestError, SaturatedError


def choose_trainer(free_slots: Mapping[str, int], models_placed: Mapping[str, int]) -> str:
    """The trainer with a free slot and the fewest models (ties: the lowest name, so placement is repeatable)."""
    candidates = [name for name, free in free_slots.items() if free > 0]
    if not candidates:
        raise SaturatedError(
            f"Every trainer is full ({len(free_slots)} trainer(s), no free adapter slot); unload a model or retry "
            "later.")
    return min(candidates, key=lambda name: (models_placed.get(name, 0), name))


def choose_sampling_trainer(sampling_session_id: str, base_model: str, served: Mapping[str, str],
                            owner: str | None = None) -> str:
    """The trainer that samples for a session: ``owner`` (the trainer of the training run whose checkpoint it
    samples, which wrote that checkpoint) when it serves the base model, else one of the trainers serving it,
    picked by the session id (so a session's samples stay on one trainer and sessions spread over the trainers).
    ``served``: trainer -> its base model."""
    if owner is not None and served.get(owner) == base_model:
        return owner
    candidates = sorted(name for name, model in served.items() if model == base_model)
    if not candidates:
        raise InvalidRequestError(
            f"No trainer serves base model {base_model!r}; sample from one of {', '.join(sorted(set(served.values())))}.")
    return candidates[zlib.crc32(sampling_session_id.encode()) % len(candidates)]
