"""Paged models' states: in host memory (pinned where CUDA is present, so the copy back is one DMA) or in one
safetensors file per model (written whole, then renamed into place). Nothing read back is unpickled.

A page file describes itself (``lilo.backend.paging.files``), so after its trainer's process dies another trainer
can restore the model from it (``read_page_file``). It is not fsynced: a process death leaves what it wrote with
the kernel, which writes it out; only a machine crash can lose it, and a page file that does not read back whole is
passed over (the model comes back from its checkpoint). A file exists only while its model is paged out to disk:
paging in, unloading and a restore delete it.

Threads: the compute lane puts, takes and drops; the persist lane may ``stage`` at the same time (read a page file
ahead of its model's turn). One lock covers the tables; ``stage`` reads its file outside it, and keeps what it read
only if the file was not rewritten meanwhile."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lilo.backend.paging.files import PAGE_FORMAT, PageFile, page_file_name
from lilo.backend.paging.mirror import PageMirror
from lilo.backend.paging.policy import DISK, HOST, PageMove, Tier, host_demotions
from lilo.backend.types import LoraSpec

# Page files read ahead and kept in memory at most (each is one model's state, about to be paged in).
MAX_STAGED = 8


@dataclasses.dataclass
class PagedState:
    """A model out of its slot: ``data`` rows are weights, exp_avg, exp_avg_sq (and gradients when ``has_grads``),
    each over the slot entries its spec trains, on the CPU."""

    spec: LoraSpec
    step: int
    has_grads: bool
    data: torch.Tensor
    # When this state left its slot (wall clock): what a restore compares with a checkpoint's capture time.
    paged_at: float = dataclasses.field(default_factory=time.time)
    # False for a model created for a restore whose load has not run yet: its fresh adapter is not the model's
    # state, and its page file must never pass for newer than the checkpoint it is about to load.
    restorable: bool = True

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PageStore:
    """Paged states in host memory (up to ``host_bytes``) and in files under ``directory`` (up to ``disk_bytes``)."""

    def __init__(self, host_bytes: int, disk_bytes: int, directory: Path, pin: bool = False,
                 mirror: PageMirror | None = None) -> None:
        self.host_bytes, self.disk_bytes, self.directory, self.pin = host_bytes, disk_bytes, directory, pin
        self.mirror = mirror  # the storage's copies of the page files (--storage), else None
        self.host: dict[str, tuple[PagedState, int]] = {}  # model -> (state, last used)
        self.disk: dict[str, tuple[LoraSpec, int, int]] = {}  # model -> (spec, bytes, last used)
        # Page files read ahead (``stage``): model -> (which write of its file, the state read).
        self.staged: OrderedDict[str, tuple[int, PagedState]] = OrderedDict()
        self._generations: dict[str, int] = {}  # model -> which write its page file is
        self._writes = 0
        self._lock = threading.Lock()
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
        with self._lock:
            return self._put(model_id, state, last_used)

    def _put(self, model_id: str, state: PagedState, last_used: int) -> list[PageMove]:
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
        """Remove ``model_id``'s state from its tier; returns it and the tier it was in (a page file read ahead by
        ``stage`` is not read again)."""
        with self._lock:
            return self._take(model_id)

    def _take(self, model_id: str) -> tuple[PagedState, Tier]:
        if model_id in self.host:
            state = self.host.pop(model_id)[0]
            self.host_used -= state.nbytes
            return state, HOST
        spec, size, _ = self.disk.pop(model_id)
        self.disk_used -= size
        generation = self._generations.pop(model_id)
        staged = self.staged.pop(model_id, None)
        path = self._path(model_id)
        state = staged[1] if staged is not None and staged[0] == generation else _read(path, spec)
        self.unlink(path)
        return state, DISK

    def unlink(self, path: Path) -> None:
        """Delete the page file ``path`` (of any trainer's under this node's page directory), and its stored copy."""
        path.unlink(missing_ok=True)
        if self.mirror is not None:
            self.mirror.deleted(path)

    def peek(self, model_id: str) -> PagedState:
        """``model_id``'s paged state, left where it is (a trainer saving its paged models as it stops)."""
        with self._lock:
            if model_id in self.host:
                return self.host[model_id][0]
            staged = self.staged.get(model_id)
            if staged is not None and staged[0] == self._generations[model_id]:
                return staged[1]
            return _read(self._path(model_id), self.disk[model_id][0])

    def drop(self, model_id: str) -> None:
        with self._lock:
            if model_id in self.host or model_id in self.disk:
                self._take(model_id)

    def stage(self, model_id: str) -> float | None:
        """Read ``model_id``'s page file ahead of its turn (on the persist lane), so its page-in takes it from
        memory; the seconds it took, or None when it is not on disk (or is staged already)."""
        with self._lock:
            if model_id not in self.disk or model_id in self.staged:
                return None
            spec, generation = self.disk[model_id][0], self._generations[model_id]
        started = time.perf_counter()
        try:
            state = _read(self._path(model_id), spec)
        except (FileNotFoundError, OSError):  # taken meanwhile: its page-in read it
            return None
        with self._lock:
            if self._generations.get(model_id) != generation:
                return None
            self.staged[model_id] = (generation, state)
            while len(self.staged) > MAX_STAGED:
                self.staged.popitem(last=False)
        return time.perf_counter() - started

    def _write(self, model_id: str, state: PagedState, last_used: int) -> float:
        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(model_id)
        temporary = path.with_name(path.name + ".tmp")
        meta = {"format": PAGE_FORMAT, "model_id": model_id, "spec": json.dumps(dataclasses.asdict(state.spec)),
                "step": str(state.step), "has_grads": "1" if state.has_grads else "0",
                "paged_at": repr(state.paged_at), "written_at": repr(time.time()),
                "restorable": "1" if state.restorable else "0"}
        save_file({"state": state.data.contiguous()}, str(temporary), metadata=meta)
        # A page file is whole or absent: a crash mid-write leaves only the temporary file.
        os.replace(temporary, path)
        if self.mirror is not None:
            self.mirror.written(path)
        self._writes += 1
        self._generations[model_id] = self._writes
        self.disk[model_id] = (state.spec, state.nbytes, last_used)
        self.disk_used += state.nbytes
        return time.perf_counter() - started

    def _path(self, model_id: str) -> Path:
        return self.directory / page_file_name(model_id)

    def _host_plan(self, nbytes: int) -> list[str] | None:
        """The host models to demote so ``nbytes`` fit in host memory, when the disk takes them (else None)."""
        demoted = host_demotions(self._host_ages(), nbytes, self.host_bytes - self.host_used)
        if demoted is None or self.disk_used + sum(self.host[m][0].nbytes for m in demoted) > self.disk_bytes:
            return None
        return demoted

    def _host_ages(self) -> dict[str, tuple[int, int]]:
        return {model: (used, state.nbytes) for model, (state, used) in self.host.items()}


@dataclasses.dataclass(frozen=True)
class PageRestore:
    """The payload of the load_weights command that restores a model from its page file, which the restoring
    trainer read and built itself (a client's load_weights always names a checkpoint): ``state`` goes into the
    model's slot, and ``files`` (all of the model's page files) are deleted as it does."""

    state: PagedState
    files: tuple[Path, ...]


def read_page_file(page: PageFile) -> PagedState:
    """The whole state a page file holds (read in full: a torn file raises here, not once installed)."""
    return _read(page.path, page.spec)


def _read(path: Path, spec: LoraSpec) -> PagedState:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        data = handle.get_tensor("state")
    return PagedState(spec, int(meta["step"]), meta["has_grads"] == "1", data, float(meta["paged_at"]),
                      meta["restorable"] == "1")
