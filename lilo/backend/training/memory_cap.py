"""A trainer process's memory cap: past it an allocation fails in that process, and the pass that asked for it fails
with a message (``TorchBackend.forward_backward``), instead of the node running out of memory and Ray's memory
monitor killing processes, the head's actors among them.

The cap is the process's data limit (``RLIMIT_DATA``: its heap and private writable mappings, so the model, the
adapter slots reserved in full whether resident yet or not, every pass's tensors; not shared memory, not mapped
files). By default a CPU trainer may take ``CPU_TRAINER_SHARE`` of its node's memory, which leaves the rest of the
node (Ray, Serve, the futures DB) room even when a pass goes wrong; a GPU trainer's passes run in GPU memory, where
running out fails the pass the same way, so by default its host memory is not capped.
"""

from __future__ import annotations

import logging
import re
import resource
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_TRAINER_SHARE = 0.8


def data_bytes() -> int:
    """What counts against the cap in this process now (``VmData``)."""
    match = re.search(r"^VmData:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def cap_bytes(setting_gb: float | None, on_gpu: bool) -> int | None:
    """The cap ``--trainer-memory-gb`` asks for (None: the default; 0: none), in bytes; None: no cap."""
    import psutil

    if setting_gb is None:
        return None if on_gpu else int(CPU_TRAINER_SHARE * psutil.virtual_memory().total)
    return int(setting_gb * 2**30) or None


def cap_memory(cap_bytes: int | None) -> int | None:
    """Cap this process's data at ``cap_bytes`` (None: no cap); returns what the cap leaves free now (None when
    uncapped). A cap below what the process already holds (its model and adapter slots) could run no pass: that is
    an error that says so."""
    if cap_bytes is None:
        return None
    held = data_bytes()
    if cap_bytes <= held:
        raise ValueError(f"--trainer-memory-gb {cap_bytes / 2**30:.1f} is below the {held / 2**30:.1f} GB this "
                         "trainer holds once its model and adapter slots are in, so no pass could run; raise it (by a "
                         "few GB for the passes) or lower --max-adapters / --max-rank.")
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        cap_bytes = min(cap_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, hard))
    logger.info("trainer memory capped at %.1f GB (%.1f GB held now)", cap_bytes / 2**30, held / 2**30)
    return cap_bytes - held
