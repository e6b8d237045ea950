"""Cluster-wide critical-path timing: the detached timing actor and the trainer-side publisher that feeds it.

Each trainer's ``TimingPublisher`` pushes, every few seconds, what its CriticalPath recorded since the previous
push (per model and its trainer-wide ``*``) to one detached, named actor. The actor merges the intervals per model,
per trainer and cluster-wide, serves snapshots with the same per-reader intervals as a trainer, exports every phase
to Ray's metrics (so Prometheus and the Ray dashboard show them), and prints the cluster's 5-minute JSON line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import orjson
import ray
from ray.util import metrics

from cluster.local import NAMESPACE
from lilo.timing.critical_path import LOG_EVENT, LOG_EVERY_S, CriticalPath
from lilo.timing.phase_stats import ALL_MODELS, DEFAULT_READER, HEADER, PhaseStats, Row, parts_of
from lilo.timing.tenant_usage import TenantUsage

logger = logging.getLogger(__name__)

TIMING_ACTOR_NAME = "lilo-timing"
PUSH_EVERY_S = 2.0
PUSH_TIMEOUT_S = 10.0
# Intervals a trainer keeps while the actor cannot be reached (it restarts, or the cluster is busy).
MAX_UNSENT_PUSHES = 64
PUSH_READER = "lilo-timing-actor"
METRIC_TAGS = ("model_id", "phase", "trainer")


@ray.remote(num_cpus=0, max_restarts=-1)
class TimingActor:
    def __init__(self, log_every_s: float = LOG_EVERY_S) -> None:
        self._cluster = PhaseStats()
        self._per_trainer: dict[str, PhaseStats] = {}
        self._gauges: dict[str, dict[str, float]] = {}
        # The cluster's own gauges (the reconciler's trainer counts), in the cluster-wide view.
        self._cluster_gauges: dict[str, float] = {}
        self._started = time.time()
        self._log_every_s = log_every_s
        self._last_aggregate_read = time.monotonic()
        self._seconds = metrics.Counter("lilo_phase_seconds", "Seconds spent per model and phase", METRIC_TAGS)
        self._count = metrics.Counter("lilo_phase_count", "Observations per model and phase", METRIC_TAGS)
        self._batch = metrics.Counter("lilo_phase_batch", "Summed batch sizes per model and phase", METRIC_TAGS)
        self._ranks = metrics.Counter("lilo_phase_ranks", "Summed ranks (processes) that ran each model's phase",
                                      METRIC_TAGS)
        self._max = metrics.Gauge("lilo_phase_max_seconds", "Longest observation in the last push", METRIC_TAGS)
        threading.Thread(target=self._log_periodically, name="lilo-timing-log", daemon=True).start()

    def push(self, trainer: str, interval: dict[str, dict[str, Row]], gauges: dict[str, float]) -> None:
        """Merge a trainer's interval (rows per model, ``*`` for the trainer-wide aggregate) and its gauges."""
        stats = self._per_trainer.setdefault(trainer, PhaseStats())
        self._gauges[trainer] = dict(gauges)
        for model_id, rows in interval.items():
            for phase, row in rows.items():
                stats.merge(model_id, phase, row)
                self._cluster.merge(model_id, phase, row)
                self._export(trainer, model_id, phase, row)

    def _export(self, trainer: str, model_id: str, phase: str, row: Row) -> None:
        for i, suffix in enumerate(parts_of(phase)):
            tags = {"model_id": model_id, "phase": phase + suffix, "trainer": trainer}
            # Ray's counters take only positive increments; a part that took no time adds nothing anyway.
            for counter, value in ((self._count, row[0]), (self._batch, row[1]), (self._ranks, row[2]),
                                   (self._seconds, row[HEADER + 2 * i])):
                if value > 0:
                    counter.inc(value, tags)
            self._max.set(row[HEADER + 1 + 2 * i], tags)

    def snapshot(self, model_id: str | None = None, reset: bool = False, reader: str = DEFAULT_READER,
                 trainer: str | None = None) -> dict[str, Any] | None:
        """The merged view (one trainer's with ``trainer=``); None when that model or trainer never reported."""
        stats = self._cluster if trainer is None else self._per_trainer.get(trainer)
        model = model_id or ALL_MODELS
        if stats is None or not stats.has_model(model):
            return None
        if model == ALL_MODELS and trainer is None:
            self._last_aggregate_read = time.monotonic()
        return {
            "model_id": model,
            "uptime_s": time.time() - self._started,
            "phases": stats.stats(model, reader=reader, reset=reset),
            "gauges": self._merged_gauges(trainer),
        }

    def set_cluster_gauges(self, gauges: dict[str, float]) -> None:
        """Gauges of the cluster as a whole (trainers starting, ready, idle), replacing the previous ones."""
        self._cluster_gauges = dict(gauges)

    def _merged_gauges(self, trainer: str | None) -> dict[str, float]:
        """One trainer's gauges, or cluster-wide the slowest trainer's value of each and the cluster's own."""
        if trainer is not None:
            return dict(self._gauges.get(trainer, {}))
        merged: dict[str, float] = dict(self._cluster_gauges)
        for gauges in self._gauges.values():
            for name, value in gauges.items():
                merged[name] = max(value, merged.get(name, value))
        return merged

    def trainers(self) -> list[str]:
        return sorted(self._per_trainer)

    def models(self) -> list[str]:
        return self._cluster.models()

    def _log_periodically(self) -> None:
        while True:
            time.sleep(self._log_every_s)
            try:
                if time.monotonic() - self._last_aggregate_read >= self._log_every_s:
                    snapshot = self.snapshot(reset=True, reader=LOG_EVENT)
                    if snapshot is not None:
                        line = {"event": LOG_EVENT, "scope": "cluster", "trainers": self.trainers(), **snapshot}
                        print(orjson.dumps(line).decode(), flush=True)
            except Exception:
                logger.exception("timing log line failed")


def get_timing_actor(name: str = TIMING_ACTOR_NAME) -> ray.actor.ActorHandle:
    """The cluster's timing actor, created on first use; it outlives whichever driver created it."""
    return TimingActor.options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


class TimingPublisher:
    """Pushes a trainer's CriticalPath to the timing actor every PUSH_EVERY_S, from a daemon thread.

    An interval that cannot be delivered is kept (up to MAX_UNSENT_PUSHES) and sent with the next push, so a
    restarting actor loses nothing a trainer recorded meanwhile.
    """

    def __init__(self, timings: CriticalPath, trainer: str, actor: ray.actor.ActorHandle,
                 every_s: float = PUSH_EVERY_S, usage: TenantUsage | None = None) -> None:
        self._timings = timings
        self._usage = usage  # exported as lilo_tenant_execute_seconds{tenant, trainer} with each push
        self._execute_gauge = (metrics.Gauge("lilo_tenant_execute_seconds", "Each tenant's share of a trainer's "
                                             "execute seconds since it started", ("tenant", "trainer"))
                               if usage is not None else None)
        self._trainer = trainer
        self._actor = actor
        self._every_s = every_s
        self._unsent: list[dict[str, dict[str, Row]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lilo-timing-publisher-{trainer}", daemon=True)

    def start(self) -> "TimingPublisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Push what is left, then stop."""
        self._stop.set()
        self._thread.join(timeout=PUSH_TIMEOUT_S + 1)

    def push_now(self) -> bool:
        """Send everything recorded and not yet delivered; True when the actor took it."""
        self._timings.drain()
        interval = self._timings.stats.take_interval(PUSH_READER)
        if interval:
            self._unsent.append(interval)
            del self._unsent[:-MAX_UNSENT_PUSHES]
        gauges = self._timings.gauges()
        if self._usage is not None:
            for tenant, share in self._usage.snapshot().items():
                self._execute_gauge.set(share["execute_s"], tags={"tenant": tenant, "trainer": self._trainer})
        try:
            if not self._unsent:  # nothing new: still refresh the gauges and show the trainer is alive
                ray.get(self._actor.push.remote(self._trainer, {}, gauges), timeout=PUSH_TIMEOUT_S)
            while self._unsent:
                ray.get(self._actor.push.remote(self._trainer, self._unsent[0], gauges), timeout=PUSH_TIMEOUT_S)
                self._unsent.pop(0)
            return True
        except Exception as error:
            logger.warning("timing push from %s failed (%s); keeping %d interval(s) for the next push",
                           self._trainer, error, len(self._unsent))
            return False

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            self.push_now()
        self.push_now()

