"""Three tiers for a trainer's models: device slots, host memory, disk. A model's whole training state (its LoRA
weights, both AdamW moments, its step count, any gradients it has accumulated, its spec) moves between them as one.

The decisions live here as pure functions of plain data (which models leave their slots, which host-memory models
go on to disk); ``lilo.backend.paging.store`` keeps the paged states, and ``TorchBackend.make_room`` carries the
decisions out. No torch here: the engine's contract names ``PageMove``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Collection, Literal, Mapping, NamedTuple

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


def page_file_wins(paged_at: float | None, checkpoint_captured_at: float | None) -> bool:
    """After its trainer died, whether a model comes back from its page file rather than its latest save_weights
    checkpoint: the newer one wins, "newer" meaning the later state in the model's history, timed by when that
    state left the device (a page file: when the model left its slot; a checkpoint: when save_weights copied it
    out). Not by optimizer steps: a load_state takes the step count back, and what follows it is still newer. A tie
    goes to the checkpoint (what the client was told is saved). None: there is no such copy."""
    if paged_at is None:
        return False
    return checkpoint_captured_at is None or paged_at > checkpoint_captured_at


class Room(NamedTuple):
    """Models a trainer can still take, per tier: free device slots, and how many models of the largest size
    (``max_rank``, every projection) its host memory and its disk still hold paged out."""

    device: int
    host: int
    disk: int

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk

    def less_one(self) -> Room:
        """The room left once one more model is placed: a new model takes a device slot while one is free, and
        pushes an idle model out to host memory, or to disk, once none is."""
        if self.device > 0:
            return self._replace(device=self.device - 1)
        if self.host > 0:
            return self._replace(host=self.host - 1)
        return self._replace(disk=max(0, self.disk - 1))


def host_adapter_bytes(host_adapter_mb: int | None, node_bytes: int | None = None) -> int:
    """The host tier of one trainer: ``host_adapter_mb`` when set, else ``DEFAULT_HOST_SHARE``'s share of
    ``node_bytes`` (this machine's memory when not given)."""
    if host_adapter_mb is not None:
        return host_adapter_mb * 2**20
    if node_bytes is None:
        node_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return node_bytes // DEFAULT_HOST_SHARE
