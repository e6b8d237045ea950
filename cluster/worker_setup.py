"""What every Ray worker of lilo's job does before it runs anything: Ray calls one of these as the job's
``worker_process_setup_hook`` (the private head's in local mode, the deploying driver's on an existing cluster).

Garbage collection is tuned for latency. CPython's defaults (700, 10, 10) promote whatever is alive at each young
collection, so under load (thousands of parked long-polls, each holding its request's objects) the oldest
generation fills fast, and every full collection scans every object with the GIL held. Under bench_load the Serve
proxy and the ingress replica each ran one every few seconds, over 400k-850k objects, for 300-650 ms: every request
in that process waited, and that was most of the heartbeat's p99. So:
- young collections run every 20,000 allocations (short-lived request objects die before they are promoted), and
  full ones a fifth as often;
- what exists once a process has started (imports, the app, the model) is frozen: it is never garbage and no
  collection scans it again. The hook freezes what Ray loaded; lilo's own actors freeze again when their start is
  done (``freeze_startup``).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading

from cluster.loopback import bind_replica_grpc_to_loopback

logger = logging.getLogger(__name__)

GC_THRESHOLDS = (20_000, 20, 50)


def tune_gc() -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    freeze_startup()


def freeze_startup() -> None:
    """Move every object alive now out of the collector's reach (collecting first, so no garbage is kept)."""
    gc.collect()
    gc.freeze()


def private_head_worker() -> None:
    """Hook of a private head (local mode): GC for latency, and Serve's replica gRPC server on loopback only."""
    tune_gc()
    bind_replica_grpc_to_loopback()


def cluster_worker() -> None:
    """Hook on an existing Ray cluster (``lilo up --address``): GC for latency."""
    tune_gc()


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer than it is (at most 19); threads it starts later (torch's)
    inherit that. On Linux niceness is per thread, so the actor's own threads (its RPCs, its writes to the futures
    DB) keep their priority."""
    if nice <= 0:
        return
    if sys.platform != "linux":
        logger.info("compute_nice=%d is applied on Linux only; the compute thread keeps its priority", nice)
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except OSError as error:
        logger.warning("could not make the compute thread %d steps nicer: %s", nice, error)
