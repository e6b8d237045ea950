"""Client side of critical-path timing: log where a model's step time went, every step, without slowing it.

    from lilo.timing import log_critical_path, flush_critical_path

    for step in range(steps):
        ...train...
        log_critical_path(model_id, step=step)      # returns at once
    flush_critical_path(timeout=10)                 # before wandb.finish()

Each call reads ``GET {TINKER_BASE_URL}/api/v1/timing?model_id=...&reset=true&reader=...`` (header ``X-API-Key``),
flattens it to ``lilo/<phase>.<stat>`` scalars and logs them to the active W&B run (found through ``sys.modules``,
so W&B stays optional) with ``commit=False`` and a ``lilo/step`` column, or prints one JSON line when there is no
run. With ``reset=True`` each call covers the interval since this reader's previous call; a ``curl`` of the same
model with another reader (or none) does not steal from it. Nothing here ever raises into a training step.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import urllib.parse
import urllib.request
from typing import Any, Callable, TextIO

from lilo.timing.critical_path import LOG_EVENT, flatten

logger = logging.getLogger(__name__)

DEFAULT_READER = "log_critical_path"
FETCH_TIMEOUT_S = 10.0
STEP_METRIC = "lilo/step"


def critical_path_metrics(model_id: str | None, *, base_url: str | None = None, api_key: str | None = None,
                          reset: bool = True, reader: str = DEFAULT_READER) -> dict[str, float]:
    """Fetch one model's critical path (or the trainer-wide aggregate for None) as flat ``lilo/...`` scalars."""
    base = (base_url or os.environ.get("TINKER_BASE_URL", "")).rstrip("/")
    if not base:
        raise ValueError("No server: pass base_url= or set TINKER_BASE_URL.")
    query = {"reset": "true" if reset else "false", "reader": reader}
    if model_id:
        query["model_id"] = model_id
    request = urllib.request.Request(
        f"{base}/api/v1/timing?{urllib.parse.urlencode(query)}",
        headers={"X-API-Key": api_key or os.environ.get("TINKER_API_KEY", "")},
    )
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
        return flatten(json.loads(response.read()))


class _Reporter:
    """One daemon worker, one report in flight: a call made while one is still fetching is dropped, not queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> bool:
        with self._lock:
            if not self._idle.is_set():
                return False
            self._idle.clear()
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="lilo-timing-reporter", daemon=True)
                self._worker.start()
        self._jobs.put(job)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a report must never take the worker down
                logger.debug("critical-path report failed", exc_info=True)
            finally:
                self._idle.set()

    def flush(self, timeout: float | None) -> bool:
        return self._idle.wait(timeout)


_reporter = _Reporter()
_runs_with_step_metric: set[str] = set()
_warned = False


def _active_wandb_run() -> Any:
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


def _report(run: Any, model_id: str | None, step: int | None, metrics: dict[str, float], file: TextIO | None) -> None:
    if run is None:
        stream = file or sys.stdout
        # One write per line: clients logging from several threads never interleave within a line.
        stream.write(json.dumps({"event": LOG_EVENT, "model_id": model_id, "step": step, **metrics}) + "\n")
        stream.flush()
        return
    run_id = getattr(run, "id", None) or str(id(run))
    if run_id not in _runs_with_step_metric:
        # Charts of lilo/* plot against the step each report describes, never W&B's global step, which a
        # background thread could not log behind without W&B dropping the values.
        run.define_metric("lilo/*", step_metric=STEP_METRIC)
        _runs_with_step_metric.add(run_id)
    run.log({**metrics, STEP_METRIC: step}, commit=False)


def _fetch_and_report(run: Any, model_id: str | None, step: int | None, file: TextIO | None,
                      **fetch: Any) -> dict[str, float]:
    global _warned
    try:
        metrics = critical_path_metrics(model_id, **fetch)
        _report(run, model_id, step, metrics, file)
        return metrics
    except Exception as error:
        if not _warned:
            logger.warning("lilo critical-path logging failed (%s); training goes on, later failures are quiet", error)
            _warned = True
        logger.debug("critical-path logging failed", exc_info=True)
        return {}


def log_critical_path(model_id: str | None, step: int | None = None, *, base_url: str | None = None,
                      api_key: str | None = None, reset: bool = True, background: bool = True,
                      reader: str = DEFAULT_READER, file: TextIO | None = None) -> dict[str, float] | None:
    """Log this model's critical path for ``step``; returns at once (None), or with ``background=False`` blocks
    and returns the metrics ({} when the fetch failed). Without a W&B run the JSON line goes to ``file``
    (default stdout). Never raises."""
    try:
        run = _active_wandb_run()  # resolved here, on the caller's thread, so a run ending mid-fetch is not mixed up
        fetch = {"base_url": base_url, "api_key": api_key, "reset": reset, "reader": reader}
        if not background:
            return _fetch_and_report(run, model_id, step, file, **fetch)
        _reporter.submit(lambda: _fetch_and_report(run, model_id, step, file, **fetch))
    except Exception:
        logger.debug("critical-path logging could not start", exc_info=True)
        return {} if not background else None
    return None


def flush_critical_path(timeout: float | None = None) -> bool:
    """Wait for the report in flight, if any; True when none is left. Call it before ``wandb.finish()``."""
    return _reporter.flush(timeout)
