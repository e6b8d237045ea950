"""How much a sampling client's polling costs the ledger: the SDK's ``retrieve_futures`` (one long-poll per sampling
client, which lilo turns on) against per-sample ``retrieve_future`` long-polls (the SDK with the flag off, as a
server that does not offer it leaves it), with ``--in-flight`` samples in flight.

Starts a private cluster (tiny model, one trainer, its own temp home, loopback only). Per round and mode, in turns: a
fresh SDK client (for ``per_sample``, its client/config answer has ``sample_use_retrieve_futures`` turned off, in this
process only) sends ``--in-flight`` samples at once, then keeps that many in flight for ``--seconds`` (each finished
one replaced by the next). The futures DB actor's own counters give the SQL statements it ran meanwhile, all of
them (submits and completions too, the same in both modes) and those of the session polls alone.

Prints one JSON line:
{"bench": "session_polls", "in_flight": .., "retrieve_futures": {"stmt_per_s": .., "stmt_per_sample": ..,
 "samples_per_s": .., "session_polls_per_s": .., "retrieves_per_sample": .., "wait_stmt_per_s": ..},
 "per_sample": {...}, "stmt_ratio": .., "wait_stmt_ratio": ..}
(``stmt_ratio``: per_sample's statements per sample over retrieve_futures'; ``wait_stmt_ratio`` the same for the
statements spent waiting; medians over ``--rounds``.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from typing import Iterator

from private_cluster import futures_actor_of, private_cluster

TINY = "lilo/tiny-llama"
MODES = ("retrieve_futures", "per_sample")


@contextlib.contextmanager
def sdk_flags(mode: str) -> Iterator[None]:
    """The SDK's client/config answer as lilo gives it, or with per-sample polling (this process only)."""
    from tinker.lib.internal_client_holder import InternalClientHolder

    if mode == "retrieve_futures":
        yield
        return
    fetch = InternalClientHolder._fetch_client_config

    async def without_session_polls(self, auth):
        return (await fetch(self, auth)).model_copy(update={"sample_use_retrieve_futures": False})

    InternalClientHolder._fetch_client_config = without_session_polls
    try:
        yield
    finally:
        InternalClientHolder._fetch_client_config = fetch


def keep_in_flight(sampler, in_flight: int, seconds: float, max_tokens: int) -> int:
    """``in_flight`` samples at once, each finished one replaced, for ``seconds``; returns how many finished."""
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    lock, done, deadline = threading.Lock(), threading.Event(), time.monotonic() + seconds
    counts = {"finished": 0, "open": 0}

    def send(k: int) -> None:
        with lock:
            counts["open"] += 1
        future = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7 + k % 500]), num_samples=1,
                                sampling_params=params)
        future.future().add_done_callback(lambda f, k=k: finished(f, k))

    def finished(future, k: int) -> None:
        future.result()  # a failed sample fails the benchmark
        with lock:
            counts["finished"] += 1
            counts["open"] -= 1
            again = time.monotonic() < deadline
            if not again and counts["open"] == 0:
                done.set()
        if again:
            send(k + in_flight)

    for k in range(in_flight):
        send(k)
    if not done.wait(seconds + 300):
        raise TimeoutError("samples still in flight 300 s after the run")
    return counts["finished"]


def measure(api_url: str, futures, mode: str, args: argparse.Namespace) -> dict[str, float]:
    import ray
    import tinker

    with sdk_flags(mode), tinker.ServiceClient(base_url=api_url, api_key="tml-bench-polls") as service:
        assert service.holder.get_client_config().sample_use_retrieve_futures == (mode == "retrieve_futures")
        sampler = service.create_sampling_client(base_model=TINY).result(timeout=120)
        keep_in_flight(sampler, 8, 0.0, args.max_tokens)  # warm: the route, the SDK's connections
        before, t0 = ray.get(futures.stats.remote()), time.monotonic()
        samples = keep_in_flight(sampler, args.in_flight, args.seconds, args.max_tokens)
        elapsed, after = time.monotonic() - t0, ray.get(futures.stats.remote())
    def per_s(key: str) -> float:
        return (after[key] - before[key]) / elapsed

    statements = after["statements"] - before["statements"]
    return {"stmt_per_s": statements / elapsed, "stmt_per_sample": statements / samples,
            "samples_per_s": samples / elapsed, "session_polls_per_s": per_s("session_polls"),
            "retrieves_per_sample": (after["retrieves"] - before["retrieves"]) / samples,
            # What waiting costs the ledger: the session polls' statements, and the per-request waiter's ticks
            # (which also serve the result fetches that follow a session poll).
            "wait_stmt_per_s": per_s("session_poll_queries") + per_s("waiter_queries")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8730)
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    from cluster.local import prepare_environment

    prepare_environment()  # before Ray is imported: this process connects as a driver of the private cluster
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with private_cluster(TINY, args.port, "--trainers", "1", "--num-cpus", "4") as home, \
            futures_actor_of(home) as futures:
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(measure(f"http://127.0.0.1:{args.port}", futures, mode, args))
    medians = {mode: {key: round(statistics.median(run[key] for run in runs[mode]), 2) for key in runs[mode][0]}
               for mode in MODES}
    def ratio(key: str) -> float:
        per_sample, polled = medians["per_sample"], medians["retrieve_futures"]
        return round((per_sample[key] / per_sample["samples_per_s"]) / (polled[key] / polled["samples_per_s"]), 2)

    print(json.dumps({"bench": "session_polls", "in_flight": args.in_flight, **medians,
                      "stmt_ratio": ratio("stmt_per_s"), "wait_stmt_ratio": ratio("wait_stmt_per_s"),
                      "seconds": args.seconds, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
