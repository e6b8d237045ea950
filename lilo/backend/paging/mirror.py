"""Page files kept in the storage as well (``--storage``), so a model whose trainer died comes back from its page
file on any node, not only on one that shares the dead trainer's disk.

A trainer writes and deletes its page files on its node's disk as before (``lilo.backend.paging.store``); this
mirror repeats each write and deletion in the storage, in order, on a thread of its own: a page-out costs the
compute lane nothing more. A page file stored late or not at all only means a restore falls back to the model's
checkpoint, as for a torn file. A restoring trainer first pulls the model's stored page files onto its node
(``pull``), then finds and reads them there as it always did.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any

from lilo.backend.paging.files import page_file_name
from lilo.storage import Storage, StorageError

logger = logging.getLogger(__name__)


class PageMirror:
    """The page files under the local directory ``local`` (``<trainer>/<model>.page.safetensors``), mirrored to
    ``storage`` under the same relative paths."""

    def __init__(self, storage: Storage, local: Path) -> None:
        self.storage, self.local = storage, local
        # (action, what): ("put" | "delete", a relative path), ("flush", an event to set), ("stop", None).
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="page-mirror", daemon=True)
        self._thread.start()

    def written(self, path: Path) -> None:
        """The page file ``path`` was (re)written: store it."""
        self._queue.put(("put", path.relative_to(self.local).as_posix()))

    def deleted(self, path: Path) -> None:
        """The page file ``path`` was deleted: delete it from the storage too (after any store of it before)."""
        self._queue.put(("delete", path.relative_to(self.local).as_posix()))

    def flush(self) -> None:
        """Wait until every write and deletion so far is done in the storage."""
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()

    def pull(self, model_id: str) -> list[Path]:
        """Every trainer's stored page file of ``model_id``, copied onto this node under the same relative paths
        (replacing what is there); the local paths."""
        pulled = []
        name = page_file_name(model_id)
        for relative in (relative for relative in self.storage.tree("") if relative.endswith(f"/{name}")):
            local = self.local / relative
            try:
                self.storage.download_file(relative, local)
            except (FileNotFoundError, StorageError) as error:  # deleted meanwhile, or unreachable: not restored
                logger.warning("page file %s could not be fetched from the storage (%s)", relative, error)
                continue
            pulled.append(local)
        return pulled

    def delete_stored(self, model_id: str, trainer: str = "*") -> None:
        """Delete ``model_id``'s stored page files: every trainer's, or ``trainer``'s alone (in order with this
        trainer's own writes)."""
        name = page_file_name(model_id)
        for relative in self.storage.tree(""):
            owner, _, file = relative.partition("/")
            if file == name and trainer in ("*", owner):
                self._queue.put(("delete", relative))

    def _run(self) -> None:
        while True:
            action, what = self._queue.get()
            if action == "stop":
                return
            if action == "flush":
                what.set()
                continue
            try:
                if action == "put" and (self.local / what).is_file():
                    self.storage.upload_file(self.local / what, what)
                elif action == "delete":
                    self.storage.delete(what)
            except (FileNotFoundError, StorageError) as error:
                logger.warning("page file %s: could not %s it in the storage (%s)", what, action, error)

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join(timeout=30)
