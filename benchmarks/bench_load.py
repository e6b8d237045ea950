"""Thousands of parked retrieve_future waiters plus training clients against one local lilo: the futures DB holds.

Starts a private cluster (tiny model, its own temp home, loopback only), then two phases of ``--seconds`` each:
1. ``--clients`` SDK clients train their own adapters (forward_backward + optim_step, as in bench_service), alone;
2. the same clients, plus ``--waiters`` concurrent ``retrieve_future`` long-polls over HTTP, each parked on its own
   pending future: forward passes of one more model, sent with seq ids 2..N+1, which wait in its queue for seq 1.
   Seq 1 is sent when the phase ends, so they all run then and every waiter gets its result.
Meanwhile a probe, in a process of its own, sends ``session_heartbeat`` every 50 ms. Then the clients stop and every
waiter is awaited.

- ``heartbeat_p99_ms`` (and ``heartbeat_p50_ms``): the probe's latency during phase 2;
- ``db_stmt_per_s`` and ``db_stmt_per_s_no_waiters``: SQL statements per second on the futures DB (its own
  counter) in phase 2 and phase 1: parked waiters must cost one query per tick between them, so the two stay close;
- ``errors``: failed requests of any kind (a step, a long-poll, a heartbeat);
- ``pending_after_s``: futures still pending ``--drain-s`` seconds after the clients stopped and seq 1 was sent.
Prints one JSON line:
{"bench": "load", "waiters": .., "clients": .., "heartbeat_p99_ms": .., "heartbeat_p50_ms": .., "db_stmt_per_s": ..,
 "db_stmt_per_s_no_waiters": .., "errors": .., "pending_after_s": ..}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import httpx
import numpy as np

from bench_service import client_loop, wait_ready
from private_cluster import futures_actor_of, private_cluster

API_KEY = "tml-bench-load"
HEADERS = {"X-API-Key": API_KEY}
TINY = "lilo/tiny-llama"
VOCAB = 1000
HEARTBEAT_EVERY_S = 0.05


class Counts:
    def __init__(self) -> None:
        self.errors = 0


async def create_parked_model(http: httpx.AsyncClient, api: str) -> tuple[str, str]:
    """A session and a model for the parked forward passes; returns (session_id, model_id)."""
    session_id = (await http.post(f"{api}/create_session", json={})).json()["session_id"]
    created = (await http.post(f"{api}/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                           "base_model": TINY, "lora_config": {"rank": 4}})).json()
    await retrieve(http, api, created["request_id"], Counts())
    return session_id, created["model_id"]


def forward_body(model_id: str, seq_id: int) -> bytes:
    """A forward pass (forward_only: the parked model's weights never change, so releasing them costs little)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tokens = [(seq_id + k) % VOCAB for k in range(9)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    return message.SerializeToString()


async def submit_forward(http: httpx.AsyncClient, api: str, model_id: str, seq_id: int) -> str:
    response = await http.post(f"{api}/forward_backward", content=forward_body(model_id, seq_id),
                               headers={"Content-Type": "application/x-protobuf"})
    response.raise_for_status()
    return response.json()["request_id"]


async def retrieve(http: httpx.AsyncClient, api: str, request_id: str, counts: Counts) -> None:
    """Long-poll one future, as the SDK does, until it has finished."""
    while True:
        try:
            response = await http.post(f"{api}/retrieve_future", json={"request_id": request_id})
        except httpx.HTTPError:
            counts.errors += 1
            return
        if response.status_code != 200:
            counts.errors += 1
            return
        if "protobuf" in response.headers.get("content-type", ""):
            return
        answer = response.json()
        if answer.get("type") != "try_again":
            counts.errors += "error" in answer
            return


def probe_heartbeats(base_url: str, session_id: str, seconds: float) -> tuple[list[float], int]:
    """In a process of its own (the clients' threads would hold this one's GIL): a session_heartbeat every 50 ms
    for ``seconds``; returns the latencies in ms and how many failed."""
    latencies, errors = [], 0
    with httpx.Client(timeout=30, headers=HEADERS) as http:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                errors += http.post(f"{base_url}/api/v1/session_heartbeat",
                                    json={"session_id": session_id}).status_code != 200
            except httpx.HTTPError:
                errors += 1
            latencies.append((time.perf_counter() - started) * 1e3)
            time.sleep(HEARTBEAT_EVERY_S)
    return latencies, errors


def futures_stats(futures) -> dict:
    import ray

    return ray.get(futures.stats.remote())


def wait_until_parked(futures, waiters: int, ended: Callable[[], int], timeout_s: float = 300.0) -> None:
    """Until every waiter's long-poll has reached the futures DB actor (each waits at the ingress first, for its
    result's push, until that long-poll times out): the phase measures a steady state with all of them parked, not
    their arrival. ``ended``: how many waiters stopped already (an HTTP error: they never park)."""
    deadline = time.monotonic() + timeout_s
    while (parked := futures_stats(futures)["parked_waiters"]) < waiters:
        if ended():
            raise RuntimeError(f"{ended()} of the {waiters} waiters stopped before they parked ({parked} parked): "
                               "their retrieve_future failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{parked} of {waiters} waiters parked after {timeout_s:.0f} s")
        time.sleep(0.2)


def db_statements(futures) -> int:
    return futures_stats(futures)["statements"]


def training_clients(base_url: str, clients: int, stop: threading.Event) -> tuple[list[threading.Thread], list]:
    import tinker

    services = [tinker.ServiceClient(base_url=base_url, api_key=API_KEY) for _ in range(clients)]
    outs: list[dict] = [{} for _ in range(clients)]
    ready, go = threading.Barrier(clients + 1), threading.Event()
    threads = [threading.Thread(target=guarded, args=(outs[i], services[i], TINY, 1, 64, VOCAB, ready, go, stop,
                                                      outs[i])) for i in range(clients)]
    for thread in threads:
        thread.start()
    wait_ready(ready, outs)
    go.set()
    return threads, outs


def guarded(out: dict, *args) -> None:
    """Run a client's loop (bench_service's); a step that fails is counted, not raised in a thread where nobody sees
    it."""
    try:
        client_loop(*args)
    except Exception as error:  # counted in the JSON line's errors
        out["error"] = repr(error)


async def run(base_url: str, futures, clients: int, waiters: int, seconds: float, drain_s: float) -> dict:
    api = f"{base_url}/api/v1"
    counts = Counts()
    limits = httpx.Limits(max_connections=waiters + 64, max_keepalive_connections=waiters + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=HEADERS) as http:
        session_id, parked_model = await create_parked_model(http, api)
        stop_clients = threading.Event()
        threads, outs = await asyncio.to_thread(training_clients, base_url, clients, stop_clients)

        try:
            # Phase 1: the clients alone.
            before = await asyncio.to_thread(db_statements, futures)
            await asyncio.sleep(seconds)
            no_waiters_per_s = (await asyncio.to_thread(db_statements, futures) - before) / seconds

            # Phase 2: plus the parked waiters, and the heartbeat probe.
            request_ids = []
            for start in range(2, waiters + 2, 256):
                request_ids += await asyncio.gather(*(submit_forward(http, api, parked_model, seq)
                                                      for seq in range(start, min(start + 256, waiters + 2))))
            parked = [asyncio.create_task(retrieve(http, api, request_id, counts)) for request_id in request_ids]
            await asyncio.to_thread(wait_until_parked, futures, waiters,
                                    lambda: sum(task.done() for task in parked))
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                probe = asyncio.get_running_loop().run_in_executor(pool, probe_heartbeats, base_url, session_id,
                                                                   seconds)
                before = await asyncio.to_thread(db_statements, futures)
                await asyncio.sleep(seconds)
                with_waiters_per_s = (await asyncio.to_thread(db_statements, futures) - before) / seconds
                heartbeats_ms, heartbeat_errors = await probe
            counts.errors += heartbeat_errors
            heartbeat_p50, heartbeat_p99 = (float(np.percentile(heartbeats_ms, q)) for q in (50, 99))
        finally:  # a failure above must not leave the clients stepping: the process would never exit
            stop_clients.set()

        # The clients stop; seq 1 releases the parked passes; everything must finish.
        for thread in threads:
            await asyncio.to_thread(thread.join, 600)
        counts.errors += sum("error" in out for out in outs)
        await submit_forward(http, api, parked_model, 1)
        await asyncio.sleep(drain_s)
        pending = (await asyncio.to_thread(futures_stats, futures))["futures"]
        await asyncio.wait_for(asyncio.gather(*parked), timeout=600)
    return {"waiters": waiters, "clients": clients, "heartbeat_p99_ms": round(heartbeat_p99, 1),
            "heartbeat_p50_ms": round(heartbeat_p50, 1),
            "db_stmt_per_s": round(with_waiters_per_s, 1), "db_stmt_per_s_no_waiters": round(no_waiters_per_s, 1),
            "errors": counts.errors, "pending_after_s": pending.get("pending", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--drain-s", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=8720)
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    from cluster.local import prepare_environment

    prepare_environment()  # before Ray is imported: this process connects as a driver of the private cluster
    # Each of 16 clients owns an adapter, plus the parked model: two trainers' worth of slots.
    with private_cluster(TINY, args.port, "--trainers", "2", "--num-cpus", "4") as home, \
            futures_actor_of(home) as futures:
        result = asyncio.run(run(f"http://127.0.0.1:{args.port}", futures, args.clients, args.waiters, args.seconds,
                                 args.drain_s))
    print(json.dumps({"bench": "load", **result, "seconds": args.seconds, "drain_s": args.drain_s}))


if __name__ == "__main__":
    main()
