"""Cost of always-on critical-path timing on the engine's hot path, with 512 models live.

Steady state of a busy trainer: every model has a command queued; each span executes one command that waited
behind the four before it (so every span also records a queue wait and its self/others/idle split).

``ns_per_span`` and ``ns_per_begin`` are what the engine's thread pays per call; ``drain_ns_per_span`` is the cost
of folding one span (and its begin) into the stats, which the background drainer (or a reader) pays. The bench
drains every 256 spans itself, as the drainer would, and times that apart. Prints one JSON line:
{"bench": "critical_path", "ns_per_span": .., "ns_per_begin": .., "drain_ns_per_span": ..,
 "snapshot_ms_512_models": .., ...}
"""

from __future__ import annotations

import argparse
import json
import time

from lilo.timing.critical_path import CriticalPath, Operation

MODELS = 512
PIPELINE = 4
DRAIN_EVERY_SPANS = 256


def run(rounds: int) -> dict:
    timings = CriticalPath(log_line=lambda line: None, drain_every_s=None)
    models = [f"model-{i}" for i in range(MODELS)]
    for model in models:
        timings.register_model(model, spec=None)
        timings.span(model, "accept", "gpu", 0.0, 0.001, ok=True)

    operations = [
        Operation(models[i % MODELS], f"{models[i % MODELS]}:{i}", "forward_backward", float(i))
        for i in range(rounds * MODELS + PIPELINE)
    ]
    begin_ns = span_ns = drain_ns = 0
    clock = float(PIPELINE)
    for i in range(PIPELINE):
        timings.begin(operations[i])
    for i in range(PIPELINE, len(operations)):
        started = time.perf_counter_ns()
        timings.begin(operations[i])
        begin_ns += time.perf_counter_ns() - started
        op = operations[i - PIPELINE]
        started = time.perf_counter_ns()
        timings.span(op.model_id, "forward_backward", "gpu", clock, clock + 0.5, request_ids=[op.request_id], n=1,
                     ok=True)
        span_ns += time.perf_counter_ns() - started
        clock += 0.5
        if i % DRAIN_EVERY_SPANS == 0:
            # What the background drainer does every few ms in a trainer, timed apart from the engine's calls.
            started = time.perf_counter_ns()
            timings.drain()
            drain_ns += time.perf_counter_ns() - started
    spans = len(operations) - PIPELINE
    started = time.perf_counter_ns()
    timings.drain()
    drain_ns += time.perf_counter_ns() - started

    started = time.perf_counter_ns()
    for model in models:
        timings.snapshot(model, reset=True, reader="bench")
    snapshot_all_ms = (time.perf_counter_ns() - started) / 1e6
    started = time.perf_counter_ns()
    timings.snapshot()
    aggregate_ms = (time.perf_counter_ns() - started) / 1e6
    return {
        "ns_per_span": round(span_ns / spans),
        "ns_per_begin": round(begin_ns / spans),
        "drain_ns_per_span": round(drain_ns / spans),
        "snapshot_ms_512_models": round(snapshot_all_ms, 2),
        "aggregate_snapshot_ms": round(aggregate_ms, 3),
        "models": MODELS,
        "spans": spans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="commands per model")
    args = parser.parse_args()
    print(json.dumps({"bench": "critical_path", **run(args.rounds)}))


if __name__ == "__main__":
    main()
