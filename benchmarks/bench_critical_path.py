"""Cost of always-on critical-path timing on the engine's hot path, with 512 models live.

Steady state of a busy trainer: every model has a command queued; each span executes one command that waited
behind the four before it (so every span also records a queue wait and its self/others/idle split).

``ns_per_span`` and ``ns_per_begin`` are what the engine's thread pays per call; ``drain_ns_per_span`` is the cost
of folding one span (and its begin) into the stats, which the background drainer (or a reader) pays. The bench
drains every 256 spans itself, as the drainer would, and times that apart.

The same run again with traces on, exporting to a collector that is down (a loopback port nothing listens on), the
trace observer beside the critical path through ``Observers`` as in a trainer: ``traced_ns_per_span`` and
``traced_ns_per_begin`` against the two above are what traces cost the engine's thread; ``trace_drain_ns_per_span``
is the trace drainer's cost of making a span (off that thread); ``trace_spans_failed`` / ``_dropped`` say the export
never got through. Prints one JSON line:
{"bench": "critical_path", "ns_per_span": .., "ns_per_begin": .., "drain_ns_per_span": ..,
 "snapshot_ms_512_models": .., "traced_ns_per_span": .., ...}
"""

from __future__ import annotations

import argparse
import json
import time

import os

from cluster.ports import free_ports
from lilo.timing.critical_path import CriticalPath, Observers, Operation

MODELS = 512
PIPELINE = 4
DRAIN_EVERY_SPANS = 256


TRACE = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)


def run(rounds: int, trace_observer=None) -> dict:
    timings = CriticalPath(log_line=lambda line: None, drain_every_s=None)
    observer = timings if trace_observer is None else Observers(timings, trace_observer)
    models = [f"model-{i}" for i in range(MODELS)]
    for model in models:
        observer.register_model(model, spec=None)
        observer.span(model, "accept", "gpu", 0.0, 0.001, ok=True)

    operations = [
        Operation(models[i % MODELS], f"{models[i % MODELS]}:{i}", "forward_backward", float(i), tokens=64,
                  trace=None if trace_observer is None else TRACE)
        for i in range(rounds * MODELS + PIPELINE)
    ]
    begin_ns = span_ns = drain_ns = trace_drain_ns = 0
    clock = float(PIPELINE)

    def drain() -> tuple[int, int]:
        # What the background drainers do every few ms in a trainer, timed apart from the engine's calls.
        started = time.perf_counter_ns()
        timings.drain()
        middle = time.perf_counter_ns()
        if trace_observer is not None:
            trace_observer.drain()
        return middle - started, time.perf_counter_ns() - middle

    for i in range(PIPELINE):
        observer.begin(operations[i])
    for i in range(PIPELINE, len(operations)):
        started = time.perf_counter_ns()
        observer.begin(operations[i])
        begin_ns += time.perf_counter_ns() - started
        op = operations[i - PIPELINE]
        started = time.perf_counter_ns()
        observer.span(op.model_id, "forward_backward", "gpu", clock, clock + 0.5, request_ids=[op.request_id], n=1,
                      ok=True)
        span_ns += time.perf_counter_ns() - started
        clock += 0.5
        if i % DRAIN_EVERY_SPANS == 0:
            timing_ns, tracing_ns = drain()
            drain_ns, trace_drain_ns = drain_ns + timing_ns, trace_drain_ns + tracing_ns
    spans = len(operations) - PIPELINE
    timing_ns, tracing_ns = drain()
    drain_ns, trace_drain_ns = drain_ns + timing_ns, trace_drain_ns + tracing_ns
    if trace_observer is not None:
        return {"traced_ns_per_span": round(span_ns / spans), "traced_ns_per_begin": round(begin_ns / spans),
                "trace_drain_ns_per_span": round(trace_drain_ns / spans)}

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
    untraced = run(args.rounds)
    traced = run(args.rounds, dead_collector_observer())
    print(json.dumps({"bench": "critical_path", **untraced, **traced, **trace_losses()}))


def dead_collector_observer():
    """A trainer's trace observer exporting to a loopback port nothing listens on (drained here, not by a thread)."""
    from lilo.timing import traces
    from lilo.timing.trace_observer import TraceObserver

    (port,) = free_ports(1)
    os.environ[traces.TRACES_ENDPOINT] = f"http://127.0.0.1:{port}/v1/traces"
    return TraceObserver(traces.tracer("trainer"), drain_every_s=None)


def trace_losses(wait_s: float = 30.0) -> dict:
    """The spans the dead collector cost, once the exporter has given up on all it was handed (or ``wait_s``)."""
    from lilo.timing.traces import export_counts

    deadline = time.monotonic() + wait_s
    while True:
        counts = export_counts()["trainer"]
        if time.monotonic() > deadline or counts["exported"] + counts["failed"] + counts["dropped"] >= 1:
            return {f"trace_spans_{name}": count for name, count in counts.items()}
        time.sleep(0.5)


if __name__ == "__main__":
    main()
