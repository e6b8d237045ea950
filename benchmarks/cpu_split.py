"""Where a benchmark's CPU went: cores used by each part of a private lilo cluster, and by the benchmark itself."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from cluster.local import cluster_processes, read_state
from lilo.settings import Settings

# Ray renames each actor's process after its class: the first word of its command line.
PARTS = {"ray::TrainerActor": "trainer", "ray::ServeReplica": "ingress", "ray::ProxyActor": "proxy",
         "ray::FuturesActor": "futures"}


def part_of(process: psutil.Process) -> str:
    title = (process.cmdline() or [""])[0]
    return next((part for prefix, part in PARTS.items() if title.startswith(prefix)), "ray_other")


class CpuSplit:
    """``start()`` then ``cores()``: CPU seconds per second of wall time between the two, per part of the cluster
    under ``home`` ("trainer", "ingress", "proxy", "futures", "ray_other") and "clients" (this process: the SDK
    clients a benchmark runs in its own threads)."""

    def __init__(self, home: Path) -> None:
        settings = Settings(home=home)
        self._processes = {process: part_of(process)
                           for process in cluster_processes(settings, read_state(settings).pid)}
        self._processes[psutil.Process(os.getpid())] = "clients"
        self._started: tuple[float, dict[str, float]] | None = None

    def _cpu_seconds(self) -> dict[str, float]:
        used = dict.fromkeys([*PARTS.values(), "ray_other", "clients"], 0.0)
        for process, part in self._processes.items():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            used[part] += times.user + times.system
        return used

    def start(self) -> None:
        self._started = (time.perf_counter(), self._cpu_seconds())

    def cores(self, digits: int = 2) -> dict[str, float]:
        started_at, before = self._started
        elapsed, after = time.perf_counter() - started_at, self._cpu_seconds()
        return {part: round((after[part] - before[part]) / elapsed, digits) for part in after}
