"""What a trainer is: its name, and the settings every trainer of a service is built with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lilo.engine.window import DEFAULT_WINDOW_CAP_MS
from lilo.settings import Settings

TRAINER_PREFIX = "lilo-trainer-"


def trainer_name(index: int) -> str:
    return f"{TRAINER_PREFIX}{index}"


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What every trainer of a service is built with, its name and base model aside: built from the settings once
    (``from_settings``) and handed to each trainer as it is."""

    max_adapters: int
    max_rank: int
    sampler_slots: int
    # "auto" (CUDA when the trainer has a GPU), "cpu" or "cuda".
    device: str
    compute_nice: int
    # None: the backend's temporary directory (tests), or the default model cache.
    checkpoint_dir: Path | None = None
    model_cache_dir: Path | None = None
    # Paging (lilo.backend.paging.policy): host memory per trainer (None: a share of its node's), disk per trainer, and
    # the directory under which each trainer keeps its page files (None: beside the checkpoints). 0 and 0: none.
    host_adapter_mb: int | None = 0
    disk_adapter_gb: float = 0.0
    page_dir: Path | None = None
    # Computed tokens per pass (None: sized from the device's free memory) and the coalescing window's cap.
    max_batch_tokens: int | None = None
    # Where checkpoints and page files are kept (lilo.storage; None: the directories above, on this node). With a
    # storage, those directories hold this node's copies, under a directory of its own (``node_directory``).
    storage: str | None = None
    # Whether passes run packed where the family allows (lilo.backend.training.packing); off: padded, the reference
    # the packed path is tested against.
    pack: bool = True
    coalesce_window_ms: float = DEFAULT_WINDOW_CAP_MS
    # The trainer process's memory cap in GB (lilo.backend.training.memory_cap; None: the default, 0: none).
    memory_gb: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> TrainerConfig:
        return cls(max_adapters=settings.max_adapters, max_rank=settings.max_rank,
                   sampler_slots=settings.sampler_slots, device=settings.device, compute_nice=settings.compute_nice,
                   checkpoint_dir=settings.home / "checkpoints", host_adapter_mb=settings.host_adapter_mb,
                   disk_adapter_gb=settings.disk_adapter_gb, page_dir=settings.home / "pages",
                   max_batch_tokens=settings.max_batch_tokens, coalesce_window_ms=settings.coalesce_window_ms,
                   memory_gb=settings.trainer_memory_gb, storage=settings.storage)

    def node_directory(self, directory: Path, node_id: str) -> Path:
        """Where this node keeps its copies of what ``directory`` holds: ``directory`` itself, or with a storage,
        a directory of this node's beside it (nodes that share a home never share copies)."""
        return directory if self.storage is None else directory.parent / "nodes" / node_id[:16] / directory.name
