"""The highest resident memory of this process while a block runs, sampled every 2 ms on a thread of its own
(torch's CPU allocations show in no counter of torch's)."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRss:
    """``with PeakRss() as peak: ...``; then ``peak.mb``: the highest RSS during the block less the RSS before it."""

    def __enter__(self) -> PeakRss:
        self._process = psutil.Process()
        self.baseline = self.peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def mb(self) -> float:
        return (self.peak - self.baseline) / 2**20
