"""Page files as files: their names, and finding, describing and deleting a model's under the pages root
(``<home>/pages/<trainer>/<model>.page.safetensors``, one directory per trainer). No torch here: the trainer
actor's event loop finds a dead trainer's page files with these (``lilo.backend.paging.store`` writes and reads the
tensors).

A page file describes itself in its safetensors metadata: its format, model id, LoRA spec, optimizer step, whether
it holds gradients not yet stepped, when the state left its slot (``paged_at``), when the file was written, and
whether it may be restored from (not the fresh adapter of a model whose restore's load had not run yet).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import struct
from pathlib import Path

from lilo.backend.types import LoraSpec

logger = logging.getLogger(__name__)

PAGE_FILE_SUFFIX = ".page.safetensors"
PAGE_FORMAT = "lilo-page-1"
# A safetensors header larger than this is not one of ours (ours are a few hundred bytes).
MAX_HEADER_BYTES = 1 << 20


def page_file_name(model_id: str) -> str:
    return model_id.replace("/", "_") + PAGE_FILE_SUFFIX


@dataclasses.dataclass(frozen=True)
class PageFile:
    """A page file found on disk, as its own metadata describes it."""

    path: Path
    model_id: str
    spec: LoraSpec
    step: int
    paged_at: float


def find_page_files(root: Path, model_id: str) -> list[PageFile]:
    """``model_id``'s page files in any trainer's directory under ``root``, newest (``paged_at``) first: a dead
    trainer's files are found by whichever trainer restores its models (on one machine, or with ``root`` on
    storage every node mounts). A file that is not a whole page file of this model is passed over."""
    found = []
    for path in root.glob(f"*/{glob.escape(page_file_name(model_id))}"):
        try:
            meta = page_metadata(path)
            if meta.get("format") != PAGE_FORMAT or meta.get("model_id") != model_id or meta["restorable"] != "1":
                continue
            found.append(PageFile(path, model_id, LoraSpec(**json.loads(meta["spec"])), int(meta["step"]),
                                  float(meta["paged_at"])))
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("page file %s does not describe itself (%s); passing it over", path, error)
    return sorted(found, key=lambda page: page.paged_at, reverse=True)


def page_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata, from its header alone (8 bytes of length, then that much JSON)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(handle.read(length))
    return header.get("__metadata__") or {}


def delete_page_files(root: Path, model_id: str, trainer: str = "*") -> None:
    """Remove ``model_id``'s page files from every trainer's directory under ``root`` (or ``trainer``'s alone):
    the model was unloaded, or restored from another copy, so none of them may bring an old state back later."""
    for path in root.glob(f"{trainer}/{glob.escape(page_file_name(model_id))}"):
        path.unlink(missing_ok=True)
