"""One SDK operation's latency and CPU against a local lilo, beside the floor of its parts on the same machine.

Starts a private cluster (its own temp home, loopback only) on the tiny model; one tinker SDK client creates an
adapter and sends ``--ops`` optim_steps one at a time (a step whose own work is a few milliseconds, so what is left
is the service's path: the HTTP submission, the record in the futures DB, the hand-over to the trainer, the result's
write and the retrieve). Reports, per operation:
- ``op_p50_ms`` / ``op_p99_ms``: as the client sees it (submitted to result);
- ``execute_ms``: the trainer's own time on it (the critical path's ``optim_step.execute``, mean);
- ``overhead_p50_ms``: the p50 less that;
- ``cpu_ms_per_op``: CPU milliseconds per operation of each part (``cpu_split``).
And the floor, measured in the same run: ``http``: a request the ingress answers from memory
(``/api/v1/healthz``) through the same port, its p50 and the ingress's and the client's CPU per request; ``ray_call``:
a call between two async actors on the same cluster (one's method awaiting the other's), its p50 and each side's CPU
per call. An operation takes two HTTP requests and four actor calls (record, hand to the trainer, write the result,
push it to the ingress), so those make its floor here: ``floor_ms``, a lower bound of its latency (one request's and
three calls' in sequence: the submission with its record and hand-over, the result's write; the retrieve's request
travels while the step runs); ``floor_cpu_ms``, of its CPU (two requests, four calls; the SDK's own not counted).
``bare``: the same client and operations against the same engine behind a bare HTTP front (``bare_service.py``: no
Ray, no ledger, nothing of lilo's), its ``op_p50_ms``, ``execute_ms`` and ``overhead_p50_ms``: what the SDK and one
HTTP front cost an operation on this machine, the floor of any service.
Prints one JSON line:
{"bench": "op_latency", "ops": .., "op_p50_ms": .., "op_p99_ms": .., "execute_ms": .., "overhead_p50_ms": ..,
 "cpu_ms_per_op": {..}, "http": {"p50_ms": .., "ingress_cpu_ms": .., "client_cpu_ms": ..},
 "ray_call": {"p50_ms": .., "caller_cpu_ms": .., "callee_cpu_ms": ..}, "floor_ms": .., "floor_cpu_ms": ..,
 "bare": {"op_p50_ms": .., "execute_ms": .., "overhead_p50_ms": ..}}
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from cluster.local import prepare_environment

prepare_environment()  # before Ray is first imported

from bare_service import bare_service  # noqa: E402
from bench_service import close_quietly  # noqa: E402
from cpu_split import CpuSplit  # noqa: E402
from private_cluster import futures_actor_of, private_cluster  # noqa: E402

API_KEY = "tml-bench-op-latency"
READER = "bench-op-latency"
BASE_MODEL = "lilo/tiny-llama"


def timed(call: Callable[[], object], count: int, home: Path | None) -> tuple[list[float], float, dict[str, float]]:
    """``call`` ``count`` times, one at a time: each one's seconds, all of them's, and the cores each part of the
    cluster in ``home`` used meanwhile (none without one)."""
    cpu = CpuSplit(home) if home is not None else None
    if cpu is not None:
        cpu.start()
    started = time.perf_counter()
    latencies = []
    for _ in range(count):
        sent = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - sent)
    return latencies, time.perf_counter() - started, cpu.cores(digits=4) if cpu is not None else {}


def sdk_operations(base_url: str, home: Path | None, ops: int) -> dict:
    import tinker
    from tinker import types

    from lilo.timing import critical_path_metrics

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
    adam = types.AdamParams(learning_rate=1e-4)
    for _ in range(20):  # warm-up
        training.optim_step(adam).result()
    critical_path_metrics(training.model_id, base_url=base_url, api_key=API_KEY, reset=True, reader=READER)
    latencies, elapsed, cores = timed(lambda: training.optim_step(adam).result(), ops, home)
    metrics = critical_path_metrics(training.model_id, base_url=base_url, api_key=API_KEY, reset=True,
                                    reader=READER)
    close_quietly(service)
    execute_ms = metrics["lilo/optim_step.execute.total_s"] / max(metrics["lilo/optim_step.execute.count"], 1) * 1e3
    p50 = float(np.percentile(latencies, 50)) * 1e3
    return {"ops": ops, "op_p50_ms": round(p50, 2), "op_p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 2),
            "execute_ms": round(execute_ms, 2), "overhead_p50_ms": round(p50 - execute_ms, 2),
            **({"cpu_ms_per_op": {part: round(used * elapsed / ops * 1e3, 2) for part, used in cores.items()}}
               if cores else {})}


def http_floor(base_url: str, home: Path, requests: int) -> dict:
    import httpx

    with httpx.Client(base_url=base_url) as client:
        for _ in range(50):
            client.get("/api/v1/healthz")
        latencies, elapsed, cores = timed(lambda: client.get("/api/v1/healthz").raise_for_status(), requests, home)
    per_request = elapsed / requests * 1e3
    return {"p50_ms": round(float(np.percentile(latencies, 50)) * 1e3, 3),
            "ingress_cpu_ms": round(cores["ingress"] * per_request, 3),
            "client_cpu_ms": round(cores["clients"] * per_request, 3)}


def ray_call_floor(calls: int) -> dict:
    """Two async actors on the benchmark's cluster (this process is its driver): the caller awaits the callee's
    method ``calls`` times, one at a time."""
    import ray

    @ray.remote(num_cpus=0)
    class Callee:
        async def echo(self, value: dict) -> dict:
            return value

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, callee) -> None:
            self.callee = callee

        def pid(self) -> int:
            return os.getpid()

        async def run(self, count: int) -> list[float]:
            latencies = []
            for n in range(count):
                sent = time.perf_counter()
                await self.callee.echo.remote({"request_id": n, "model_id": "bench"})
                latencies.append(time.perf_counter() - sent)
            return latencies

    callee = Callee.remote()
    caller = Caller.remote(callee)
    processes = [psutil.Process(ray.get(actor.pid.remote())) for actor in (caller, callee)]
    ray.get(caller.run.remote(100))  # warm-up
    before = [sum(process.cpu_times()[:2]) for process in processes]
    latencies = ray.get(caller.run.remote(calls))
    used = [sum(process.cpu_times()[:2]) - was for process, was in zip(processes, before)]
    for actor in (caller, callee):
        ray.kill(actor)
    return {"p50_ms": round(float(np.percentile(latencies, 50)) * 1e3, 3),
            "caller_cpu_ms": round(used[0] / calls * 1e3, 3), "callee_cpu_ms": round(used[1] / calls * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--floor-calls", type=int, default=1000)
    parser.add_argument("--port", type=int, default=8760)
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    base_url = f"http://127.0.0.1:{args.port}"
    with private_cluster(BASE_MODEL, args.port) as home:
        line = {"bench": "op_latency", **sdk_operations(base_url, home, args.ops)}
        line["http"] = http_floor(base_url, home, args.floor_calls)
        with futures_actor_of(home):  # connects this process to the cluster as a driver
            line["ray_call"] = ray_call_floor(args.floor_calls)
    with bare_service(args.port + 1, max_adapters=1) as bare_url:
        bare = sdk_operations(bare_url, None, args.ops)
    http, ray_call = line["http"], line["ray_call"]
    line["floor_ms"] = round(http["p50_ms"] + 3 * ray_call["p50_ms"], 2)
    line["floor_cpu_ms"] = round(2 * (http["ingress_cpu_ms"] + http["client_cpu_ms"])
                                 + 4 * (ray_call["caller_cpu_ms"] + ray_call["callee_cpu_ms"]), 2)
    line["bare"] = {key: bare[key] for key in ("op_p50_ms", "execute_ms", "overhead_p50_ms")}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
