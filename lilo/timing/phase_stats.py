"""A bounded accumulator of per-(model, phase) durations with per-reader intervals.

Each series row holds ``count``, the summed batch size, the summed ranks (how many processes ran it: more than one
on a trainer that spans several devices) and, per *part*, a total and a max. Most phases have one part; a
``<kind>.queue_wait`` phase has five (the wait, its self / others / idle split, and the part of others that other
tenants' passes took), kept in one row so a queue wait costs one update instead of five. Rows expand into one phase
per part when read.

Readers: ``stats(model, reader=r, reset=True)`` returns the interval since reader ``r`` last reset that model, so two
readers never split each other's interval. A reader that never reset a model sees everything since the start.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Sequence

ALL_MODELS = "*"
DEFAULT_READER = ""
# Per-model series kept at once (the ALL_MODELS aggregate is exempt); least recently updated model evicted first.
MAX_SERIES = 512
# Named readers kept at once (the default reader is exempt); least recently used reader evicted first.
MAX_READERS = 16

QUEUE_WAIT = "queue_wait"
# The wait, its split (behind the model's own earlier commands, behind other models' passes, idle), and of the part
# behind others, what passes holding no model of its own tenant took (lilo.timing.critical_path.split_wait).
QUEUE_WAIT_PARTS = ("", "_self", "_others", "_idle", "_other_tenants")
SINGLE_PART = ("",)

Row = list  # [count, batch_total, ranks_total, total_0, max_0, total_1, max_1, ...]
HEADER = 3  # count, batch_total, ranks_total


def parts_of(phase: str) -> tuple[str, ...]:
    """Suffixes of the phases one row of ``phase`` expands into."""
    return QUEUE_WAIT_PARTS if phase.endswith(QUEUE_WAIT) else SINGLE_PART


def new_row(phase: str) -> Row:
    return [0, 0, 0] + [0.0, 0.0] * len(parts_of(phase))


def summarize(phase: str, count: int, batch_total: float, ranks_total: float,
              totals_maxes: list) -> dict[str, dict[str, float]]:
    """Expand one row's numbers into ``{phase+suffix: {count, total_s, mean_s, max_s, mean_batch, mean_ranks}}``."""
    out = {}
    for i, suffix in enumerate(parts_of(phase)):
        total, peak = totals_maxes[2 * i], totals_maxes[2 * i + 1]
        out[phase + suffix] = {
            "count": count,
            "total_s": total,
            "mean_s": total / count if count else 0.0,
            "max_s": peak,
            "mean_batch": batch_total / count if count else 0.0,
            "mean_ranks": ranks_total / count if count else 0.0,
        }
    return out


class _Reader:
    """Where one reader's interval starts: per model, the row values at its last reset and the maxes since."""

    __slots__ = ("baseline", "maxes")

    def __init__(self) -> None:
        self.baseline: dict[str, dict[str, tuple]] = {}
        self.maxes: dict[str, dict[str, list[float]]] = {}


class PhaseStats:
    """Thread-safe: the engine's lanes record while the trainer's endpoint reads."""

    def __init__(self, max_series: int = MAX_SERIES, max_readers: int = MAX_READERS) -> None:
        self._max_series = max_series
        self._max_readers = max_readers
        self._aggregate: dict[str, Row] = {}
        self._series: OrderedDict[str, dict[str, Row]] = OrderedDict()
        self._readers: OrderedDict[str, _Reader] = OrderedDict({DEFAULT_READER: _Reader()})
        # The readers that ever reset a model: only they track maxes, so records skip the others.
        self._resetting: list[_Reader] = []
        self._lock = threading.Lock()

    # --- writing -------------------------------------------------------------------------------------------
    def record(self, model_id: str, phase: str, values: tuple[float, ...], batch: int, ranks: int = 1) -> None:
        """One observation of ``phase`` for ``model_id`` (and the aggregate); ``values`` has one entry per part."""
        self.record_many(((model_id, phase, values, batch, ranks),))

    def record_many(self, observations: Sequence[tuple[str, str, tuple[float, ...], int, int]]) -> None:
        """Several observations (model_id, phase, values, batch, ranks) under one lock: one span's worth."""
        add = self._add
        with self._lock:
            for model_id, phase, values, batch, ranks in observations:
                add(self._aggregate, ALL_MODELS, phase, 1, batch, ranks, values, values)
                add(self._model_rows(model_id), model_id, phase, 1, batch, ranks, values, values)

    def merge(self, model_id: str, phase: str, row: Row) -> None:
        """Add a row recorded elsewhere (another trainer's interval); ``model_id`` may be ALL_MODELS."""
        totals, maxes = row[HEADER::2], row[HEADER + 1::2]
        with self._lock:
            rows = self._aggregate if model_id == ALL_MODELS else self._model_rows(model_id)
            self._add(rows, model_id, phase, row[0], row[1], row[2], totals, maxes)

    def _model_rows(self, model_id: str) -> dict[str, Row]:
        rows = self._series.get(model_id)
        if rows is None:
            rows = self._series[model_id] = {}
            if len(self._series) > self._max_series:
                evicted, _ = self._series.popitem(last=False)
                self._forget_in_readers(evicted)
        else:
            self._series.move_to_end(model_id)
        return rows

    def _add(self, rows: dict[str, Row], model_id: str, phase: str, count: int, batch: float, ranks: float,
             totals: Sequence[float], maxes: Sequence[float]) -> None:
        row = rows.get(phase)
        if row is None:
            row = rows[phase] = new_row(phase)
        row[0] += count
        row[1] += batch
        row[2] += ranks
        if len(totals) == 1:  # the common case, unrolled: this runs on every span of the engine
            row[HEADER] += totals[0]
            if maxes[0] > row[HEADER + 1]:
                row[HEADER + 1] = maxes[0]
        else:
            for i, total in enumerate(totals):
                row[HEADER + 2 * i] += total
                if maxes[i] > row[HEADER + 2 * i + 1]:
                    row[HEADER + 2 * i + 1] = maxes[i]
        for reader in self._resetting:
            since_reset = reader.maxes.get(model_id)
            if since_reset is not None:
                peaks = since_reset.get(phase)
                if peaks is None:
                    since_reset[phase] = list(maxes)
                else:
                    for i, peak in enumerate(maxes):
                        if peak > peaks[i]:
                            peaks[i] = peak

    def forget(self, model_id: str) -> None:
        """Drop a model's series and every reader's interval of it; the aggregate keeps what it was credited."""
        with self._lock:
            self._series.pop(model_id, None)
            self._forget_in_readers(model_id)

    def _forget_in_readers(self, model_id: str) -> None:
        for reader in self._readers.values():
            reader.baseline.pop(model_id, None)
            reader.maxes.pop(model_id, None)

    # --- reading -------------------------------------------------------------------------------------------
    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id == ALL_MODELS or model_id in self._series

    def models(self) -> list[str]:
        with self._lock:
            return list(self._series)

    def stats(self, model_id: str = ALL_MODELS, reader: str = DEFAULT_READER,
              reset: bool = False) -> dict[str, dict[str, float]]:
        """``{phase: {count, total_s, mean_s, max_s, mean_batch, mean_ranks}}`` over the reader's interval of this
        model."""
        with self._lock:
            out: dict[str, dict[str, float]] = {}
            for phase, header, totals_maxes in self._interval(model_id, self._reader(reader), reset):
                out.update(summarize(phase, *header, totals_maxes))
            return out

    def take_interval(self, reader: str) -> dict[str, dict[str, Row]]:
        """Every model's (and the aggregate's) rows since this reader's last take, resetting them for it."""
        with self._lock:
            handle = self._reader(reader)
            taken = {}
            for model_id in [ALL_MODELS, *self._series]:
                rows = {}
                for phase, header, totals_maxes in self._interval(model_id, handle, reset=True):
                    if header[0]:
                        rows[phase] = [*header, *totals_maxes]
                if rows:
                    taken[model_id] = rows
            return taken

    def _reader(self, name: str) -> _Reader:
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = _Reader()
            if len(self._readers) > self._max_readers + 1:
                # The oldest named reader goes; the default reader (first in order) never does.
                oldest = next(key for key in self._readers if key != DEFAULT_READER)
                evicted = self._readers.pop(oldest)
                if evicted in self._resetting:
                    self._resetting.remove(evicted)
        elif name != DEFAULT_READER:
            self._readers.move_to_end(name)
        return reader

    def _interval(self, model_id: str, reader: _Reader, reset: bool) -> Iterator[tuple[str, list, list]]:
        """(phase, [count, batch_total, ranks_total], [total_0, max_0, ...]) of each phase in the interval."""
        rows = self._aggregate if model_id == ALL_MODELS else self._series.get(model_id, {})
        baseline = reader.baseline.get(model_id, {})
        maxes = reader.maxes.get(model_id)
        for phase, row in rows.items():
            base = baseline.get(phase)
            header = [row[i] - (base[i] if base else 0) for i in range(HEADER)]
            count = header[0]
            totals_maxes = []
            for i in range(len(parts_of(phase))):
                total = row[HEADER + 2 * i] - (base[HEADER + i] if base else 0.0)
                if maxes is None:
                    peak = row[HEADER + 1 + 2 * i]
                else:
                    peaks = maxes.get(phase)
                    peak = peaks[i] if peaks is not None and count else 0.0
                totals_maxes += [total, peak]
            yield phase, header, totals_maxes
        if reset:
            reader.baseline[model_id] = {
                phase: (*row[:HEADER], *row[HEADER::2]) for phase, row in rows.items()
            }
            reader.maxes[model_id] = {}
            if reader not in self._resetting:
                self._resetting.append(reader)
