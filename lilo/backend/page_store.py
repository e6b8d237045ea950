"""Paged models' states: in host memory (pinned where CUDA is present, so the copy back is one DMA) or in one
safetensors file per model (written whole, then renamed into place). Nothing read back is unpickled."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lilo.backend.paging import DISK, HOST, PageMove, Tier, host_demotions
from lilo.backend.types import LoraSpec

PAGE_FILE_SUFFIX = ".page.safetensors"


@dataclasses.dataclass
class PagedState:
    """A model out of its slot: ``data`` rows are weights, exp_avg, exp_avg_sq (and gradients when ``has_grads``),
    each over the slot entries its spec trains, on the CPU."""

    spec: LoraSpec
    step: int
    has_grads: bool
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PageStore:
    """Paged states in host memory (up to ``host_bytes``) and in files under ``directory`` (up to ``disk_bytes``)."""

    def __init__(self, host_bytes: int, disk_bytes: int, directory: Path, pin: bool = False) -> None:
        self.host_bytes, self.disk_bytes, self.directory, self.pin = host_bytes, disk_bytes, directory, pin
        self.host: dict[str, tuple[PagedState, int]] = {}  # model -> (state, last used)
        self.disk: dict[str, tuple[LoraSpec, int, int]] = {}  # model -> (spec, bytes, last used)
        # Running totals, not sums over the dicts: a trainer's event loop reads them while its compute lane pages.
        self.host_used = 0
        self.disk_used = 0

    def __contains__(self, model_id: str) -> bool:
        return model_id in self.host or model_id in self.disk

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)

    def tier_of(self, model_id: str) -> Tier:
        return HOST if model_id in self.host else DISK

    def room_for(self, nbytes: int) -> bool:
        """Whether a state of ``nbytes`` can be paged out now (to host memory, demoting others to disk as needed,
        or straight to disk)."""
        return self._host_plan(nbytes) is not None or self.disk_used + nbytes <= self.disk_bytes

    def put(self, model_id: str, state: PagedState, last_used: int) -> list[PageMove]:
        """Keep ``state``: in host memory when it fits (moving the least recently used there to disk first), else
        on disk. The caller checked ``room_for``."""
        moves: list[PageMove] = []
        demoted = self._host_plan(state.nbytes)
        if demoted is not None:
            for model in demoted:
                old, used = self.host.pop(model)
                self.host_used -= old.nbytes
                moves.append(PageMove(model, "out", DISK, self._write(model, old, used)))
            if self.pin and state.data.device.type == "cpu" and not state.data.is_pinned():
                state.data = state.data.pin_memory()
            self.host[model_id] = (state, last_used)
            self.host_used += state.nbytes
        else:
            self._write(model_id, state, last_used)
        return moves

    def take(self, model_id: str) -> tuple[PagedState, Tier]:
        """Remove ``model_id``'s state from its tier; returns it and the tier it was in."""
        if model_id in self.host:
            state = self.host.pop(model_id)[0]
            self.host_used -= state.nbytes
            return state, HOST
        spec, size, _ = self.disk.pop(model_id)
        self.disk_used -= size
        path = self._path(model_id)
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
            data = handle.get_tensor("state")
        path.unlink(missing_ok=True)
        return PagedState(spec, int(meta["step"]), meta["has_grads"] == "1", data), DISK

    def drop(self, model_id: str) -> None:
        if model_id in self.host:
            self.take(model_id)
        elif model_id in self.disk:
            self.disk_used -= self.disk.pop(model_id)[1]
            self._path(model_id).unlink(missing_ok=True)

    def _write(self, model_id: str, state: PagedState, last_used: int) -> float:
        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(model_id)
        temporary = path.with_name(path.name + ".tmp")
        meta = {"spec": json.dumps(dataclasses.asdict(state.spec)), "step": str(state.step),
                "has_grads": "1" if state.has_grads else "0"}
        save_file({"state": state.data.contiguous()}, str(temporary), metadata=meta)
        # A page file is whole or absent: a crash mid-write leaves only the temporary file.
        os.replace(temporary, path)
        self.disk[model_id] = (state.spec, state.nbytes, last_used)
        self.disk_used += state.nbytes
        return time.perf_counter() - started

    def _path(self, model_id: str) -> Path:
        return self.directory / (model_id.replace("/", "_") + PAGE_FILE_SUFFIX)

    def _host_plan(self, nbytes: int) -> list[str] | None:
        """The host models to demote so ``nbytes`` fit in host memory, when the disk takes them (else None)."""
        demoted = host_demotions(self._host_ages(), nbytes, self.host_bytes - self.host_used)
        if demoted is None or self.disk_used + sum(self.host[m][0].nbytes for m in demoted) > self.disk_bytes:
            return None
        return demoted

    def _host_ages(self) -> dict[str, tuple[int, int]]:
        return {model: (used, state.nbytes) for model, (state, used) in self.host.items()}
