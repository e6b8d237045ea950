"""A trainer's checkpoints: kept in their storage, read and written through this node's copies.

A save writes its directory on this node's disk (``<home>/checkpoints``; with ``--storage``,
``<home>/nodes/<node>/checkpoints``) on the persist lane, and, where the storage
is elsewhere (``--storage``: an object store or a mount every node has), stores it there in the same lane, its
marker last: a checkpoint is listed once it is whole in the storage, and an upload that fails fails the save with a
message, leaving it unlisted. A load or a sample reads this node's copy, fetched from the storage first when this
node has none or an older one: each upload stores a version file (a random token) beside the checkpoint's files,
which a copy is compared by (an object store's times have seconds only), at most every ``RECHECK_S`` per
checkpoint, so a sampling batch does not ask the storage each time. With the default storage (the home itself) the
copy is the checkpoint and nothing moves.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from lilo.backend.checkpoints.index import COMPLETE_MARKERS, VERSION_FILE, relative_directory
from lilo.backend.checkpoints.paths import local_directory, parse_tinker_path
from lilo.errors import NotFoundError
from lilo.storage import Storage, StorageError

# How long a copy checked against the storage is taken as current without asking again.
RECHECK_S = 5.0


class CheckpointShelf:
    """The checkpoints of ``store`` as seen from this node, whose copies live under ``local``."""

    def __init__(self, store: Storage, local: Path) -> None:
        self.storage, self.local = store, local
        self.remote = not (store.is_local and store.local_path("").resolve() == local.resolve())
        self._lock = threading.Lock()
        self._storing: set[str] = set()
        self._checked: dict[str, float] = {}  # path -> when this node's copy was last found current

    def directory(self, path: str) -> Path:
        """Where this node's copy of the checkpoint ``path`` is (or goes)."""
        return local_directory(self.local, path)

    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[Path]:
        """The directory on this node a save of ``path`` writes; once written whole, it is uploaded to the storage
        (nothing to do when the storage is this node's home), its marker last. A failed upload raises StorageError
        naming the checkpoint, which is then neither saved nor listed."""
        with self._lock:
            self._storing.add(path)
        try:
            yield self.directory(path)
            if self.remote:
                self._upload(path)
        finally:
            with self._lock:
                self._storing.discard(path)

    def _upload(self, path: str) -> None:
        directory, marker = self.directory(path), _marker(path)
        version = uuid.uuid4().hex
        (directory / VERSION_FILE).write_text(version)
        try:
            self.storage.upload_tree(directory, relative_directory(path), marker)
        except StorageError as error:
            raise StorageError(f"The checkpoint {path} was written on its trainer but could not be stored, so it is "
                               f"not saved and not listed: {error}") from error
        with self._lock:
            self._checked[path] = time.monotonic()

    def fetched(self, path: str) -> Path:
        """This node's whole, current copy of the checkpoint ``path`` (fetched from the storage when needed);
        NotFoundError when the storage has no whole checkpoint there."""
        directory, marker = self.directory(path), _marker(path)
        if not self.remote:
            return directory
        with self._lock:
            mine = path in self._storing  # this node's own write under way: its copy is the newest
            checked = self._checked.get(path)
        whole_here = (directory / marker).is_file()
        if whole_here and (mine or (checked is not None and time.monotonic() - checked < RECHECK_S)):
            return directory
        relative = relative_directory(path)
        stored = self.storage.files(relative)
        if marker not in stored:
            raise NotFoundError(f"No checkpoint {path!r} in the storage (deleted, or never saved whole); pass a "
                                "path a save returned.")
        if not whole_here or _version_of(directory) != self._stored_version(relative, stored):
            try:
                self.storage.download_tree(relative, directory, marker)
            except FileNotFoundError:  # deleted, or being saved again, meanwhile
                raise NotFoundError(f"The checkpoint {path!r} changed in the storage while it was being "
                                    "fetched; retry.") from None
        with self._lock:
            self._checked[path] = time.monotonic()
        return directory

    def _stored_version(self, relative: str, stored: dict) -> str | None:
        try:
            return self.storage.read(f"{relative}/{VERSION_FILE}").decode() if VERSION_FILE in stored else None
        except FileNotFoundError:
            return None

    def forget(self, path: str) -> None:
        """Drop what this node knows of ``path`` (deleted from the storage): its next use asks the storage."""
        with self._lock:
            self._checked.pop(path, None)


def _marker(path: str) -> str:
    return COMPLETE_MARKERS[parse_tinker_path(path)[1]]


def _version_of(directory: Path) -> str | None:
    try:
        return (directory / VERSION_FILE).read_text()
    except FileNotFoundError:
        return None
