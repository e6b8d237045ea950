"""Checkpoints on disk as clients see them: a training run's list, deleting one, and the LoRA spec of a weights
checkpoint (to create a model from it).

Layout (``checkpoint_paths.local_directory``): ``<root>/<run>/{weights|sampler_weights}/<name>/``, written by the
trainer that owns the run. These functions run on that trainer too (``TrainerActor.list_checkpoints`` and
friends), so they see the files wherever they are; on a multi-node cluster, loading or sampling a checkpoint on a
different trainer than the one that wrote it needs ``root`` on storage every node mounts (the cluster home on a
shared filesystem).
Nothing a client sends reaches outside ``root``: run ids and names are checked, and every directory is resolved and
checked to lie under it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from lilo.backend.checkpoints.paths import (
    KIND_DIRECTORIES, META_FILE, PEFT_CONFIG, TINKER_SCHEME, checked_name, local_directory, parse_tinker_path,
)
from lilo.backend.types import LoraSpec
from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError, NotFoundError

WEIGHTS, SAMPLER_WEIGHTS = KIND_DIRECTORIES[Kind.SAVE_WEIGHTS], KIND_DIRECTORIES[Kind.SAVE_WEIGHTS_FOR_SAMPLER]
EXTERNAL_WEIGHTS = KIND_DIRECTORIES[Kind.SAVE_WEIGHTS_EXTERNAL]
# The file each kind writes last: a directory without it is still being written (or its write was cut short).
COMPLETE_MARKERS = {WEIGHTS: META_FILE, SAMPLER_WEIGHTS: PEFT_CONFIG, EXTERNAL_WEIGHTS: PEFT_CONFIG}


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


def list_checkpoints(root: Path, run: str) -> list[CheckpointEntry]:
    """The complete checkpoints of ``run``, oldest first."""
    found = []
    for kind, marker in COMPLETE_MARKERS.items():
        directory = _inside(root, root / _checked_run(run) / kind)
        if not directory.is_dir():
            continue
        for entry in directory.iterdir():
            if (entry / marker).is_file() and _checked_name_or_none(entry.name):
                try:
                    stats = [path.stat() for path in entry.iterdir() if path.is_file()]
                except FileNotFoundError:  # deleted while we looked
                    continue
                if not stats:
                    continue
                found.append(CheckpointEntry(run, kind, entry.name, max(stat.st_mtime for stat in stats),
                                             sum(stat.st_size for stat in stats)))
    return sorted(found, key=lambda checkpoint: (checkpoint.time_s, checkpoint.checkpoint_id))


def latest_weights(root: Path, run: str) -> tuple[CheckpointEntry, float] | None:
    """``run``'s latest save_weights checkpoint (the last written) and when its state was captured (read from its
    metadata file; its write time for a checkpoint saved before lilo recorded that); None when it has none."""
    latest = max((entry for entry in list_checkpoints(root, run) if entry.kind == WEIGHTS),
                 key=lambda entry: entry.time_s, default=None)
    if latest is None:
        return None
    meta = json.loads((local_directory(root, latest.tinker_path) / META_FILE).read_text())
    captured = meta.get("captured_at")
    return latest, latest.time_s if captured is None else float(captured)


def delete_checkpoint(root: Path, run: str, checkpoint_id: str) -> None:
    """Remove ``<run>/<checkpoint_id>`` (``<kind directory>/<name>``) from disk."""
    directory = _inside(root, local_directory(root, checkpoint_path(run, checkpoint_id)))
    if not directory.is_dir():
        raise NotFoundError(f"Training run {run!r} has no checkpoint {checkpoint_id!r}; list its checkpoints for "
                            "the ids there are.")
    shutil.rmtree(directory)


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


def checkpoint_files(root: Path, path: str) -> dict[str, int]:
    """``file name -> size`` of the complete checkpoint ``path`` (plain files directly in its directory; links and
    anything else are left out, so nothing served from here can lead elsewhere)."""
    directory = _complete_directory(root, path)
    return {entry.name: entry.stat().st_size for entry in sorted(directory.iterdir())
            if entry.is_file() and not entry.is_symlink()}


def read_checkpoint_file(root: Path, path: str, file: str, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes of one file of the checkpoint ``path``, from ``offset``; only a file that
    ``checkpoint_files`` lists can be read."""
    if file not in checkpoint_files(root, path):
        raise NotFoundError(f"Checkpoint {path!r} has no file {file!r}; ask for its download links again.")
    with open(_complete_directory(root, path) / file, "rb") as opened:
        opened.seek(offset)
        return opened.read(length)


def copy_checkpoint(root: Path, source: str, destination: str) -> None:
    """Make ``destination`` hold the files of ``source``, as hard links where the filesystem allows (no bytes are
    duplicated, and deleting either leaves the other whole), else as copies. A copy already there is kept."""
    files = checkpoint_files(root, source)
    target = _inside(root, local_directory(root, destination))
    if target.is_dir():
        return
    staging = target.with_name(f".{target.name}.copying")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in files:
        origin = _complete_directory(root, source) / name
        try:
            os.link(origin, staging / name)
        except OSError:  # another filesystem, or one without hard links
            shutil.copy2(origin, staging / name)
    staging.rename(target)  # whole or not at all: a listing never sees half a copy


def _complete_directory(root: Path, path: str) -> Path:
    """The directory of the complete checkpoint ``path`` (its kind's marker written), else NotFoundError."""
    _, kind, _ = parse_tinker_path(path)
    directory = _inside(root, local_directory(root, path))
    if not (directory / COMPLETE_MARKERS[kind]).is_file():
        raise NotFoundError(f"No checkpoint {path!r} here (deleted, or never saved); pass a path a save returned.")
    return directory


def weights_spec(root: Path, path: str) -> LoraSpec:
    """The LoRA spec a ``save_weights`` checkpoint was saved with (read from its small metadata file only)."""
    _, kind, _ = parse_tinker_path(path)
    if kind != WEIGHTS:
        raise InvalidRequestError(f"{path!r} is not a training checkpoint; pass a path save_state (save_weights) "
                                  "returned: tinker://<run>/weights/<name>.")
    try:
        meta = json.loads((_inside(root, local_directory(root, path)) / META_FILE).read_text())
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


def _inside(root: Path, directory: Path) -> Path:
    """``directory``, once it is certain to lie under ``root`` (symlinks followed)."""
    if not directory.resolve().is_relative_to(root.resolve()):
        raise InvalidRequestError(f"{directory.name!r} lies outside the checkpoint directory; pass an id the "
                                  "checkpoint list gave.")
    return directory
