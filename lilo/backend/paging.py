"""Three tiers for a trainer's models: device slots, host memory, disk. A model's whole training state (its LoRA
weights, both AdamW moments, its step count, any gradients it has accumulated, its spec) moves between them as one.

The decisions live here as pure functions of plain data (which models leave their slots, which host-memory models
go on to disk); ``lilo.backend.page_store`` keeps the paged states, and ``TorchBackend.make_room`` carries the
decisions out. No torch here: the engine's contract names ``PageMove``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Collection, Literal, Mapping

# The default host tier: a sixteenth of the node's memory per trainer (eight trainers of an 8-GPU node: half).
DEFAULT_HOST_SHARE = 16

Tier = Literal["host", "disk"]
HOST: Tier = "host"
DISK: Tier = "disk"


@dataclasses.dataclass(frozen=True)
class PageMove:
    """One model's state moved: ``direction`` "in" (to a slot, from ``tier``) or "out" (from a slot, or from host
    memory when ``tier`` is disk, to ``tier``); ``seconds`` of wall time."""

    model_id: str
    direction: Literal["in", "out"]
    tier: Tier
    seconds: float


def choose_victims(last_used: Mapping[str, int], count: int, running: Collection[str],
                   queued: Collection[str]) -> list[str]:
    """Which ``count`` resident models leave their slots: the ones idle longest (lowest ``last_used``) among those
    with no queued work first; a model with queued work only when every other resident model has some too (else
    more models than slots all waiting would deadlock); never one in ``running``. Fewer than ``count`` when that is
    all there is."""
    idle = sorted((used, model) for model, used in last_used.items() if model not in running and model not in queued)
    waiting = sorted((used, model) for model, used in last_used.items() if model not in running and model in queued)
    return [model for _, model in (idle + waiting)[:count]]


def host_demotions(host: Mapping[str, tuple[int, int]], needed_bytes: int, host_free_bytes: int) -> list[str] | None:
    """Which host-memory models (``model -> (last_used, bytes)``) go to disk so ``needed_bytes`` fit: the least
    recently used first. None when even all of them would not make room."""
    demoted, free = [], host_free_bytes
    for model, (_, size) in sorted(host.items(), key=lambda item: item[1][0]):
        if free >= needed_bytes:
            break
        demoted.append(model)
        free += size
    return demoted if free >= needed_bytes else None


def host_adapter_bytes(host_adapter_mb: int | None, node_bytes: int | None = None) -> int:
    """The host tier of one trainer: ``host_adapter_mb`` when set, else ``DEFAULT_HOST_SHARE``'s share of
    ``node_bytes`` (this machine's memory when not given)."""
    if host_adapter_mb is not None:
        return host_adapter_mb * 2**20
    if node_bytes is None:
        node_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return node_bytes // DEFAULT_HOST_SHARE
