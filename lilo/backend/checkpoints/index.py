"""Checkpoints in their storage as clients see them: a training run's list, deleting one, its files, and the LoRA
spec of a weights checkpoint (to create a model from it).

Layout (``checkpoint_paths.local_directory``): ``<root>/<run>/{weights|sampler_weights|external_weights}/<name>/``,
where ``root`` is the checkpoints' storage (``lilo.storage``): the home on the trainer's own node by default, or a
mount or object store every trainer reaches (``--storage``). These functions run on a trainer
(``TrainerActor.list_checkpoints`` and friends); a checkpoint counts once its kind's marker file is stored, which
its writer stores last.
Nothing a client sends reaches outside ``root``: run ids and names are checked, and on a local filesystem every
directory is resolved and checked to lie under it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from lilo.backend.checkpoints.paths import (
    KIND_DIRECTORIES, META_FILE, PEFT_CONFIG, TINKER_SCHEME, checked_name, parse_tinker_path,
)
from lilo.backend.types import LoraSpec
from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError, NotFoundError
from lilo.storage import Storage

WEIGHTS, SAMPLER_WEIGHTS = KIND_DIRECTORIES[Kind.SAVE_WEIGHTS], KIND_DIRECTORIES[Kind.SAVE_WEIGHTS_FOR_SAMPLER]
EXTERNAL_WEIGHTS = KIND_DIRECTORIES[Kind.SAVE_WEIGHTS_EXTERNAL]
# The file each kind writes last: a directory without it is still being written (or its write was cut short).
COMPLETE_MARKERS = {WEIGHTS: META_FILE, SAMPLER_WEIGHTS: PEFT_CONFIG, EXTERNAL_WEIGHTS: PEFT_CONFIG}
# Which upload of a checkpoint a copy is (lilo.backend.checkpoints.stored): kept beside its files, never listed or
# served as one of them (no hidden file is: a storage's staging files are hidden too).
VERSION_FILE = ".version"


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint on disk: ``<run>/<kind>/<name>``, when it was written and its size."""

    run: str
    kind: str  # WEIGHTS or SAMPLER_WEIGHTS
    name: str
    time_s: float
    size_bytes: int

    @property
    def checkpoint_id(self) -> str:
        # What the SDK calls the checkpoint id: the tinker path without the run.
        return f"{self.kind}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"{TINKER_SCHEME}{self.run}/{self.checkpoint_id}"


Root = Path | Storage


def as_storage(root: Root) -> Storage:
    """``root`` as a Storage (a Path is a directory on this node)."""
    return root if isinstance(root, Storage) else Storage(root)


def list_checkpoints(root: Root, run: str) -> list[CheckpointEntry]:
    """The complete checkpoints of ``run``, oldest first (one listing of the run's tree)."""
    store = as_storage(root)
    _inside(store, _checked_run(run))
    trees: dict[tuple[str, str], dict[str, tuple[float, int]]] = {}
    for relative, info in store.tree(run).items():
        parts = relative.split("/")
        if (len(parts) == 3 and parts[0] in COMPLETE_MARKERS and _checked_name_or_none(parts[1])
                and not parts[2].startswith(".")):
            trees.setdefault((parts[0], parts[1]), {})[parts[2]] = (info.mtime_ns / 1e9, info.size)
    found = [CheckpointEntry(run, kind, name, max(time_s for time_s, _ in files.values()),
                             sum(size for _, size in files.values()))
             for (kind, name), files in trees.items() if COMPLETE_MARKERS[kind] in files]
    return sorted(found, key=lambda checkpoint: (checkpoint.time_s, checkpoint.checkpoint_id))


def latest_weights(root: Root, run: str) -> tuple[CheckpointEntry, float] | None:
    """``run``'s latest save_weights checkpoint (the last written) and when its state was captured (read from its
    metadata file; its write time for a checkpoint saved before lilo recorded that); None when it has none."""
    store = as_storage(root)
    latest = max((entry for entry in list_checkpoints(store, run) if entry.kind == WEIGHTS),
                 key=lambda entry: entry.time_s, default=None)
    if latest is None:
        return None
    meta = json.loads(store.read(f"{relative_directory(latest.tinker_path)}/{META_FILE}"))
    captured = meta.get("captured_at")
    return latest, latest.time_s if captured is None else float(captured)


def delete_checkpoint(root: Root, run: str, checkpoint_id: str) -> None:
    """Remove ``<run>/<checkpoint_id>`` (``<kind directory>/<name>``) from its storage, its marker first."""
    store = as_storage(root)
    path = checkpoint_path(run, checkpoint_id)
    directory = _inside(store, relative_directory(path))
    if not store.files(directory):
        raise NotFoundError(f"Training run {run!r} has no checkpoint {checkpoint_id!r}; list its checkpoints for "
                            "the ids there are.")
    store.delete_tree(directory, COMPLETE_MARKERS[parse_tinker_path(path)[1]])


def checkpoint_path_parts(path: str) -> tuple[str, str]:
    """``(run, checkpoint id)`` of a ``tinker://`` checkpoint path: the inverse of ``checkpoint_path``."""
    run, kind, name = parse_tinker_path(path)
    return run, f"{kind}/{name}"


def checkpoint_path(run: str, checkpoint_id: str) -> str:
    """The tinker path of ``checkpoint_id`` in ``run``; anything but ``{weights|sampler_weights}/<name>`` is
    refused."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in COMPLETE_MARKERS or not name:
        raise InvalidRequestError(f"Checkpoint id {checkpoint_id!r} is not of the form weights/<name>, "
                                  "sampler_weights/<name> or external_weights/<name>; pass an id the checkpoint "
                                  "list gave.")
    checked_name(name)
    return f"{TINKER_SCHEME}{_checked_run(run)}/{kind}/{name}"


def relative_directory(path: str) -> str:
    """Where the ``tinker://`` checkpoint ``path`` lies in its storage: ``<run>/<kind directory>/<name>``."""
    return "/".join(parse_tinker_path(path))


def checkpoint_files(root: Root, path: str) -> dict[str, int]:
    """``file name -> size`` of the complete checkpoint ``path`` (plain files directly in its directory; on a local
    filesystem links are left out, so nothing served from here can lead elsewhere)."""
    store = as_storage(root)
    return {name: info.size for name, info in sorted(_complete_files(store, path).items())}


def read_checkpoint_file(root: Root, path: str, file: str, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes of one file of the checkpoint ``path``, from ``offset``; only a file that
    ``checkpoint_files`` lists can be read."""
    store = as_storage(root)
    if file not in _complete_files(store, path):
        raise NotFoundError(f"Checkpoint {path!r} has no file {file!r}; ask for its download links again.")
    return store.read(f"{relative_directory(path)}/{file}", offset, length)


def copy_checkpoint(root: Root, source: str, destination: str) -> None:
    """Make ``destination`` hold the files of ``source``: on a local filesystem as hard links where it allows
    (no bytes are duplicated, and deleting either leaves the other whole), else as copies, the marker last. A copy
    already there is kept."""
    store = as_storage(root)
    files = _complete_files(store, source)
    target = _inside(store, relative_directory(destination))
    marker = COMPLETE_MARKERS[parse_tinker_path(destination)[1]]
    if marker in store.files(target):
        return
    if not store.is_local:
        store.copy_tree(relative_directory(source), target, marker)
        return
    staging = store.local_path(target).with_name(f".{Path(target).name}.copying")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in files:
        origin = store.local_path(f"{relative_directory(source)}/{name}")
        try:
            os.link(origin, staging / name)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(origin, staging / name)
    staging.rename(store.local_path(target))  # whole or not at all: a listing never sees half a copy


def _complete_files(store: Storage, path: str) -> dict:
    """The files of the complete checkpoint ``path`` (its kind's marker stored), else NotFoundError."""
    _, kind, _ = parse_tinker_path(path)
    directory = _inside(store, relative_directory(path))
    files = {name: info for name, info in store.files(directory).items() if not name.startswith(".")}
    if COMPLETE_MARKERS[kind] not in files:
        raise NotFoundError(f"No checkpoint {path!r} here (deleted, or never saved); pass a path a save returned.")
    if store.is_local:
        files = {name: info for name, info in files.items()
                 if not store.local_path(f"{directory}/{name}").is_symlink()}
    return files


def weights_spec(root: Root, path: str) -> LoraSpec:
    """The LoRA spec a ``save_weights`` checkpoint was saved with (read from its small metadata file only)."""
    store = as_storage(root)
    _, kind, _ = parse_tinker_path(path)
    if kind != WEIGHTS:
        raise InvalidRequestError(f"{path!r} is not a training checkpoint; pass a path save_state (save_weights) "
                                  "returned: tinker://<run>/weights/<name>.")
    try:
        meta = json.loads(store.read(f"{_inside(store, relative_directory(path))}/{META_FILE}"))
    except FileNotFoundError:
        raise NotFoundError(f"No training checkpoint {path!r} here (deleted, or never saved); pass a path "
                            "save_state returned.") from None
    return LoraSpec(**meta["spec"])


def _checked_name_or_none(name: str) -> str | None:
    try:
        return checked_name(name)
    except InvalidRequestError:
        return None


def _checked_run(run: str) -> str:
    if run in ("", ".", "..") or "/" in run or "\\" in run or "\x00" in run:
        raise InvalidRequestError(f"Training run id {run!r} is not one; pass a model_id create_model returned.")
    return run


def _inside(store: Storage, relative: str) -> str:
    """``relative``, once it is certain to lie under ``store`` (on a local filesystem, symlinks followed; an
    object store has no links, and names are checked before they get here)."""
    if store.is_local and not store.local_path(relative).resolve().is_relative_to(store.local_path("").resolve()):
        raise InvalidRequestError(f"{Path(relative).name!r} lies outside the checkpoint directory; pass an id the "
                                  "checkpoint list gave.")
    return relative
