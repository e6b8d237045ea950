"""A session's timeline as a trace file (``tinker session export-trace``): every request of its training runs and
sampling sessions as a slice from when the ledger recorded it to when it finished, one track per run or sampling
session, and each run's critical path (its phases' totals, counts and how many commands shared each execution) as a
slice over its requests. Written in the Chrome trace-event JSON format, which https://ui.perfetto.dev opens as it
opens a Perfetto protobuf trace (the CLI names the file ``.pftrace`` either way)."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

MICROS = 1e6
MAX_REQUESTS = 200_000  # a trace holds the first this many requests of a session (its file stays under ~60 MB)


def session_trace(session_id: str, requests: Sequence[Mapping[str, Any]],
                  critical_paths: Mapping[str, Mapping[str, Any]], now: float) -> bytes:
    """The trace of ``requests`` (the ledger's rows: model_id, kind, request_id, seq_id, status, submitted_at,
    finished_at, trainer, error), ``critical_paths`` by model id (``GET /api/v1/timing``'s flattened snapshot);
    a request still pending ends at ``now``."""
    start = min((row["submitted_at"] for row in requests), default=now)
    tracks = {model_id: index + 1 for index, model_id in enumerate(dict.fromkeys(row["model_id"] for row in requests))}
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": session_id}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": model_id}}
               for model_id, tid in tracks.items()]
    spans: dict[str, list[float]] = {}
    for row in requests[:MAX_REQUESTS]:
        begin, end = row["submitted_at"], row["finished_at"] or now
        span = spans.setdefault(row["model_id"], [begin, end])
        span[0], span[1] = min(span[0], begin), max(span[1], end)
        events.append({"ph": "X", "name": row["kind"], "cat": row["status"], "pid": 1, "tid": tracks[row["model_id"]],
                       "ts": (begin - start) * MICROS, "dur": max(end - begin, 0.0) * MICROS,
                       "args": {key: row[key] for key in ("request_id", "seq_id", "status", "trainer", "error")
                                if row.get(key) is not None}})
    for model_id, phases in critical_paths.items():
        if model_id in spans:
            begin, end = spans[model_id]
            events.append({"ph": "X", "name": "critical path", "cat": "timing", "pid": 1, "tid": tracks[model_id],
                           "ts": (begin - start) * MICROS, "dur": (end - begin) * MICROS, "args": dict(phases)})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"session_id": session_id, "requests": len(requests),
                                     "written_requests": min(len(requests), MAX_REQUESTS)}}).encode()
