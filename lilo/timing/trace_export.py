"""Export of finished spans that never holds the span's owner (``traces``): a bounded queue and one thread."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExportResult

logger = logging.getLogger(__name__)

# Spans waiting for export in one process; past it new ones are dropped (counted), never waited for.
MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
EXPORT_EVERY_S = 0.5
# How long a process that shuts down waits for its last spans to go out.
SHUTDOWN_FLUSH_S = 2.0


@dataclasses.dataclass
class ExportCounts:
    exported: int = 0
    dropped: int = 0  # the queue was full
    failed: int = 0  # the collector refused them or could not be reached


class BoundedExport(SpanProcessor):
    """A span processor that never blocks the span's owner: finished spans are queued (a full queue drops them)
    and one daemon thread exports them in batches through ``exporter``."""

    def __init__(self, exporter: Any, max_queued: int = MAX_QUEUED_SPANS, every_s: float = EXPORT_EVERY_S) -> None:
        self._exporter = exporter
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._every_s = every_s
        self._idle = threading.Event()
        self._idle.set()
        self.counts = ExportCounts()
        self._warned: set[str] = set()
        threading.Thread(target=self._export_forever, name="lilo-trace-export", daemon=True).start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            self.counts.dropped += 1
            self._warn_once("dropped", "spans are being dropped: more than %d wait for export", self._queue.maxsize)

    def _export_forever(self) -> None:
        while True:
            batch = [self._queue.get()]
            self._idle.clear()
            while len(batch) < EXPORT_BATCH:
                try:
                    batch.append(self._queue.get(timeout=self._every_s if len(batch) == 1 else 0))
                except queue.Empty:
                    break
            try:
                result = self._exporter.export(batch)
            except Exception:  # the exporter's own failures, whatever they are, lose this batch only
                result = SpanExportResult.FAILURE
            if result == SpanExportResult.SUCCESS:
                self.counts.exported += len(batch)
            else:
                self.counts.failed += len(batch)
                self._warn_once("failed", "the trace collector refused or missed %d spans; later failures are "
                                "counted, not logged", len(batch))
            if self._queue.empty():
                self._idle.set()

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        self.force_flush(int(SHUTDOWN_FLUSH_S * 1000))
