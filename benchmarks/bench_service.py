"""K tinker SDK clients, each stepping its own adapter (forward_backward + optim_step) against a local lilo.

Starts a private cluster (its own temp home, loopback only) serving ``--model``, then for each K runs K clients
concurrently for ``--seconds``, each in a loop of forward_backward (``--rows`` sequences of ``--seq`` tokens) and
optim_step, and stops the cluster. Per K:
- ``tok_s``: training tokens per second, all clients together;
- ``step_p50_ms`` / ``step_p99_ms``: a client's step (both futures resolved), as the client sees it;
- ``overhead_p50_ms``: per operation, the service's own cost (HTTP, the futures DB, polling, scheduling): for each
  client, its steps' total time minus what the trainer spent on them from the critical path, per step, halved; the
  median over the clients. The trainer's part: both commands' execute time, and the forward_backward's wait behind
  other models' executions (the optim_step, sent with it, waits behind the same ones at the same time; its wait
  behind others after its own forward_backward ran is counted as overhead, so this errs high). Both sides sum the
  same steps;
- ``fairness``: most steps any client completed over fewest;
- ``mean_batch``: how many clients' forward_backward shared one execution (median over the clients);
- ``coalesce_wait_ms``: the mean time a forward_backward spent in its pass's coalescing window (median over the
  clients; ``lilo.engine.window``);
- ``pass_ms``: per step, the trainer's time on the passes this client's step waited for: its forward_backward's pass,
  and its optim_step's wait behind the other models' optim_steps and its own (median over the clients); ``gap_ms``:
  ``step_p50_ms`` minus that, the part of a lockstep step the trainer spends without this step's work (results on
  their way back, the next step's requests on their way in, the coalescing window); ``engine_step_ms``: the same
  step's work in the engine alone, K adapters coalesced (the ceiling below). So ``tok_s`` over the ceiling is about
  ``engine_step_ms / (pass_ms + gap_ms)``: how much the pass slows beside the service, and how much the trainer waits;
- ``cpu_cores``: CPU seconds per second in the window, per part: the trainers, the ingress replica (which serves
  the HTTP port itself), Serve's proxy (idle: no request goes through it), the futures DB actor, the rest of Ray,
  and the clients (this process). On a small machine the clients and the service share the cores the trainer
  computes on; this says how. ``cpu_ms_per_op``: the same, in CPU milliseconds per operation (a forward_backward
  or an optim_step).
The trainer has a slot for every client's model (``--max-adapters``, default the largest K), as the ceiling's engine
has. Each ``--windows`` value (``--coalesce-window-ms`` of its own cluster; 0: no window) runs every K, the clusters up
together and taking turns per K, so both see the same machine. ``ceiling``: the engine alone in this process (no
service, one torch thread as a trainer has), one adapter and K adapters coalesced, each measured just before the
service runs K; ``of_ceiling``:
each window's largest-K ``tok_s`` over that ceiling (``of_ceiling_by_clients``: each K's over K coalesced).
``--trace``: the cluster exports its traces to a receiver in this process, and each K gets ``gap_split`` (median ms
from an optim_step pass's end to the results written, the first and last next forward_backward at the ingress, the
last recorded, the last handed to the trainer, the next pass: ``gap_split.py``). Tracing costs CPU, so compare a
traced run's other figures only with another traced run's.
``--bare``: each K runs once more against the same engine behind a bare HTTP front (``bare_service.py``: no Ray, no
ledger, no auth, nothing of lilo's), the machine's own ceiling for SDK clients: ``bare`` (the same figures as a window's
but the CPU split) and ``of_bare_by_clients`` (each window's ``tok_s`` over the bare front's, per K).
Prints one JSON line:
{"bench": "service", "model": .., "windows": {"100": [{"clients": K, "tok_s": .., "step_p50_ms": .., "step_p99_ms": ..,
 "overhead_p50_ms": .., "fairness": .., "mean_batch": .., "coalesce_wait_ms": .., "cpu_cores": {"trainer": .., ...}},
 ...], "0": [...]}, "ceiling": {"clients": K, "one_tok_s": .., "coalesced_tok_s": ..}, "of_ceiling": {"100": ..},
 "step_p50_ratio_1_client": .. (the first window's over the last's)}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

import numpy as np

from cpu_split import CpuSplit
from gap_split import gap_split
from otlp_receiver import OtlpReceiver
from private_cluster import private_cluster

API_KEY = "tml-bench-service"
READER = "bench-service"
MODELS = {"tiny": "lilo/tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def client_loop(service, base_model: str, rows: int, seq: int, vocab: int, ready: threading.Barrier,
                go: threading.Event, stop: threading.Event, out: dict) -> None:
    """One client: its model made and warmed up, it waits at ``ready`` for the others, then steps from ``go`` until
    ``stop`` (``out``: its ``model_id`` and ``steps``). One that fails before it is ready says why in ``out["error"]``
    and breaks ``ready``, so that the benchmark stops at once (``wait_ready``) instead of waiting for it."""
    from tinker import types

    try:
        training = service.create_lora_training_client(base_model=base_model, rank=8).result()
        rng = np.random.default_rng(abs(hash(training.model_id)) % 2**32)
        tokens = rng.integers(0, vocab, (rows, seq + 1))
        data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": row[1:].tolist(), "weights": [1.0] * seq})
                for row in tokens]
        adam = types.AdamParams(learning_rate=1e-4)
        training.forward_backward(data, "cross_entropy").result()  # warm-up, outside the window
        training.optim_step(adam).result()
    except Exception as error:
        out["error"] = repr(error)
        ready.abort()
        raise
    out["model_id"] = training.model_id
    steps = []
    ready.wait()
    go.wait()
    while not stop.is_set():
        started = time.perf_counter()
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(adam)
        backward.result()
        optim.result()
        steps.append(time.perf_counter() - started)
    out["steps"] = steps


def trainer_side(base_url: str, model_id: str) -> tuple[float, float, float, float]:
    """Since this reader's last read: seconds the trainer spent on this model's steps (executing them, or running
    other models' work while its forward_backward waited), how many commands shared its forward_backward
    executions on average, its forward_backwards' mean coalescing wait, and the trainer's seconds a step on the
    passes its step waited for (its forward_backward's, and its optim_step's and those of the other models ahead of
    it)."""
    from lilo.timing import critical_path_metrics

    metrics = critical_path_metrics(model_id, base_url=base_url, api_key=API_KEY, reset=True, reader=READER)

    def total(*phases: str) -> float:
        return sum(metrics.get(f"lilo/{phase}.total_s", 0.0) for phase in phases)

    busy = total("forward_backward.execute", "forward_backward.queue_wait_others", "optim_step.execute")
    passes = metrics.get("lilo/forward_backward.execute.count", 0.0)
    window_s = total("forward_backward.coalesce_wait") / max(passes, 1)
    pass_s = total("forward_backward.execute", "optim_step.execute", "optim_step.queue_wait_others") / max(passes, 1)
    return busy, metrics.get("lilo/forward_backward.execute.mean_batch", 0.0), window_s, pass_s


def close_quietly(service) -> None:
    """Finish a client's session, giving up after a minute: once in a few hundred closes the SDK's close never
    returned (its finish request was never answered, while lilo answered the same request from curl at once; seen
    with the SDK 0.38.0), and what the benchmark measured is already in hand."""
    import concurrent.futures

    try:
        service.close("success").result(timeout=60)
    except concurrent.futures.TimeoutError:
        print(f"{sys.argv[0]}: a client's close did not return within 60 s; going on", file=sys.stderr)


def wait_ready(ready: threading.Barrier, outs: list[dict]) -> None:
    """Wait for every client at ``ready``; raises, with the first one's error, when one failed before it."""
    try:
        ready.wait(timeout=600)
    except threading.BrokenBarrierError:
        failed = next((out["error"] for out in outs if "error" in out), "a client did not get ready in 600 s")
        raise RuntimeError(f"a client failed before the benchmark started: {failed}") from None


def run(base_url: str, base_model: str, clients: int, seconds: float, rows: int, seq: int, vocab: int,
        cpu: CpuSplit | None, traces: OtlpReceiver | None = None) -> dict:
    """K clients against ``base_url``, their steps split by its critical path (and, given ``cpu``, the CPU of each
    part of its cluster)."""
    import tinker

    services = [tinker.ServiceClient(base_url=base_url, api_key=API_KEY) for _ in range(clients)]
    outs: list[dict] = [{} for _ in range(clients)]
    ready, go, stop = threading.Barrier(clients + 1), threading.Event(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(services[i], base_model, rows, seq, vocab, ready, go,
                                                          stop, outs[i])) for i in range(clients)]
    for thread in threads:
        thread.start()
    wait_ready(ready, outs)
    for out in outs:
        trainer_side(base_url, out["model_id"])  # start this reader's interval where the clients' steps start
    go.set()
    started, started_ns = time.perf_counter(), time.time_ns()
    if cpu is not None:
        cpu.start()
    time.sleep(seconds)
    cores = cpu.cores(digits=4) if cpu is not None else {}
    window_ns = (started_ns, time.time_ns())
    stop.set()
    for thread in threads:
        thread.join(timeout=600)
    elapsed = time.perf_counter() - started
    steps = [out["steps"] for out in outs]
    all_steps = np.array([s for client in steps for s in client])
    trainer = [trainer_side(base_url, out["model_id"]) for out in outs]
    overhead = [(sum(out["steps"]) - busy) / max(len(out["steps"]), 1) / 2
                for (busy, *_), out in zip(trainer, outs)]
    pass_ms = float(np.median([pass_s for *_, pass_s in trainer])) * 1e3
    for service in services:
        close_quietly(service)
    step_p50 = float(np.percentile(all_steps, 50))
    ops_per_s = 2 * len(all_steps) / elapsed  # a forward_backward and an optim_step a step
    split = {} if traces is None else {"gap_split": gap_split(traces.spans_between(*window_ns))}
    return {**split,
        "clients": clients,
        "tok_s": round(sum(len(s) for s in steps) * rows * seq / elapsed, 1),
        "step_p50_ms": round(step_p50 * 1e3, 1),
        "step_p99_ms": round(float(np.percentile(all_steps, 99)) * 1e3, 1),
        "overhead_p50_ms": round(float(np.median(overhead)) * 1e3, 1),
        "fairness": round(max(len(s) for s in steps) / max(min(len(s) for s in steps), 1), 2),
        "mean_batch": round(float(np.median([batch for _, batch, _, _ in trainer])), 2),
        "coalesce_wait_ms": round(float(np.median([wait for _, _, wait, _ in trainer])) * 1e3, 1),
        "pass_ms": round(pass_ms, 1),
        "gap_ms": round(step_p50 * 1e3 - pass_ms, 1),
        **({"cpu_cores": {part: round(used, 2) for part, used in cores.items()},
            "cpu_ms_per_op": {part: round(used / ops_per_s * 1e3, 2) for part, used in cores.items()}}
           if cores else {}),
    }


class EngineCeiling:
    """Tokens/s of the engine alone on the tiny model in this process, one torch thread as a trainer has: K adapters
    coalesced (``bench_coalesce``'s measure, the best of two). Measured for each K just before the service runs K
    clients (the clusters are up and idle then), so that both see the machine in the same minute: its speed here
    drifts by a tenth or more within a run."""

    def __init__(self, rows: int, seq: int) -> None:
        import tempfile
        from pathlib import Path

        import torch

        from lilo.backend.models import build_tiny_llama, load_base_model

        torch.set_num_threads(1)
        self._rows, self._seq = rows, seq
        with tempfile.TemporaryDirectory() as directory:
            self._base = load_base_model(build_tiny_llama(Path(directory) / "tiny"))
        self.tok_s: dict[int, float] = {}

    def measure(self, adapters: int) -> float:
        from bench_coalesce import engine_tok_s

        self.tok_s[adapters] = round(max(engine_tok_s(self._base, adapters, self._rows, self._seq, steps=7,
                                                      coalesce=True) for _ in range(2)), 1)
        return self.tok_s[adapters]

    def summary(self) -> dict:
        """``one_tok_s`` (one adapter), ``coalesced_by_clients`` (each K over 1) and the largest K's
        (``coalesced_tok_s``)."""
        largest = max(self.tok_s)
        return {"clients": largest, "one_tok_s": self.tok_s.get(1), "coalesced_tok_s": self.tok_s[largest],
                "coalesced_by_clients": {k: tok_s for k, tok_s in self.tok_s.items() if k > 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--windows", default="100,0",
                        help="--coalesce-window-ms of each cluster compared (0: no window)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--port", type=int, default=8710)
    parser.add_argument("--max-adapters", type=int,
                        help="the trainer's adapter slots (default: the largest K, at least lilo's default 16): every "
                             "client's model held at once, as the ceiling's engine holds its K")
    parser.add_argument("--trace", action="store_true",
                        help="add each K's gap_split, from the cluster's traces (which cost CPU: compare traced runs "
                             "with traced runs)")
    parser.add_argument("--bare", action="store_true",
                        help="also run each K against the engine behind a bare HTTP front (bare_service.py): the "
                             "machine's ceiling for SDK clients, with nothing of lilo's between them and the engine")
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    traces = None
    if args.trace:
        traces = OtlpReceiver()
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = traces.endpoint  # handed to every process of the cluster
    base_model = MODELS[args.model]
    counts = [int(k) for k in args.clients.split(",")]
    windows = args.windows.split(",")
    engine = EngineCeiling(args.rows, args.seq) if args.model == "tiny" else None
    with contextlib.ExitStack() as clusters:
        slots = str(args.max_adapters or max(16, *counts))
        homes = [clusters.enter_context(private_cluster(base_model, args.port + 2 * i, "--coalesce-window-ms", w,
                                                        "--max-adapters", slots))
                 for i, w in enumerate(windows)]
        bare_url = None
        if args.bare:
            from bare_service import bare_service

            bare_url = clusters.enter_context(bare_service(args.port + 2 * len(windows), int(slots)))
        from lilo.backend.models import model_directory

        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_directory(base_model)).vocab_size
        results: dict[str, list] = {w: [] for w in windows}
        bare: list[dict] = []
        for k in counts:
            if engine is not None:
                engine.measure(k)
            for i, (window, home) in enumerate(zip(windows, homes)):
                base_url = f"http://127.0.0.1:{args.port + 2 * i}"
                results[window].append(run(base_url, base_model, k, args.seconds, args.rows, args.seq, vocab,
                                           CpuSplit(home), traces))
            if bare_url is not None:
                bare.append(run(bare_url, base_model, k, args.seconds, args.rows, args.seq, vocab, None))
    line = {"bench": "service", "model": args.model, "rows": args.rows, "seq": args.seq, "seconds": args.seconds,
            "traced": args.trace, "windows": results}
    if engine is not None:
        ceiling = engine.summary()
        line["ceiling"] = ceiling
        line["of_ceiling"] = {w: round(runs[-1]["tok_s"] / ceiling["coalesced_tok_s"], 3)
                              for w, runs in results.items()}
        line["of_ceiling_by_clients"] = {w: {str(r["clients"]): round(r["tok_s"] / ceiling["coalesced_by_clients"][
            r["clients"]], 3) for r in runs if r["clients"] > 1} for w, runs in results.items()}
        for runs in results.values():
            for r in runs:
                engine_tok_s = ceiling["coalesced_by_clients"].get(r["clients"], ceiling["one_tok_s"])
                r["engine_step_ms"] = round(r["clients"] * args.rows * args.seq / engine_tok_s * 1e3, 1)
    if bare:
        line["bare"] = bare
        line["of_bare_by_clients"] = {w: {str(r["clients"]): round(r["tok_s"] / b["tok_s"], 3)
                                          for r, b in zip(runs, bare)} for w, runs in results.items()}
    if len(windows) > 1 and counts[0] == 1:
        line["step_p50_ratio_1_client"] = round(results[windows[0]][0]["step_p50_ms"]
                                                / results[windows[-1]][0]["step_p50_ms"], 3)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
