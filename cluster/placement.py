"""Which trainer a new model goes to: a pure function of the trainers' loads."""

from __future__ import annotations

from typing import Mapping

from lilo.errors import SaturatedError


def choose_trainer(free_slots: Mapping[str, int], models_placed: Mapping[str, int]) -> str:
    """The trainer with a free slot and the fewest models (ties: the lowest name, so placement is repeatable)."""
    candidates = [name for name, free in free_slots.items() if free > 0]
    if not candidates:
        raise SaturatedError(
            f"Every trainer is full ({len(free_slots)} trainer(s), no free adapter slot); unload a model or retry "
            "later.")
    return min(candidates, key=lambda name: (models_placed.get(name, 0), name))
