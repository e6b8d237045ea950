"""The futures database under the seed's load shape, in-process (``--target store``) or through the Ray actor.

Defaults: 16 models, 128 concurrent submitters, 512 dispatchable requests plus 512 parked behind optim_step
barriers, ~76 KiB of JSON per request (4 sequences x 512 tokens with targets and weights), 512 concurrent waiters.
Phases: submit; scan_parked (metadata scan + barrier logic over the whole backlog, every scheduler tick);
scan_ready (that scan plus loading and decoding the 512 dispatchable payloads into arrays, as a trainer takes them); complete (all results, in batches
of 64); await (the waiters parked on still-pending futures for a while: SQL statements per second). SQL statements
and commits are counted per phase. Prints one JSON line:
{"bench": "futures", "target": .., "submit_ops": .., "submit_p99_ms": .., "scan_parked_p50_ms": ..,
 "scan_ready_p50_ms": .., "complete_s": .., "await_stmt_per_s": .., "db_mb": .., "wal_mb": .., ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from lilo.futures.group_commit import GroupCommitter
from lilo.futures.scheduling import dispatchable
from lilo.futures.store import Completion, FuturesStore, Submission
from lilo.futures.waiter import FutureWaiter

SEQUENCES, TOKENS = 4, 512
SCAN_REPEATS = 9
AWAIT_S = 3.0
PER_CALLER_POLL_S = 0.1


def payload(rng: random.Random) -> dict:
    datum = lambda: {  # noqa: E731
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [rng.randrange(49152) for _ in range(TOKENS)]}]},
        "loss_fn_inputs": {"target_tokens": [rng.randrange(49152) for _ in range(TOKENS)],
                           "weights": [rng.random() for _ in range(TOKENS)]},
    }
    return {"forward_backward_input": {"data": [datum() for _ in range(SEQUENCES)], "loss_fn": "cross_entropy"}}


def workload(models: int, ready: int, parked: int, seed: int = 0) -> list[Submission]:
    """Per model: its share of dispatchable forward_backwards, then an optim_step barrier with the parked rest."""
    rng = random.Random(seed)
    shared = payload(rng)  # one body reused: the store still encodes, hashes and writes each copy
    subs = []
    for m in range(models):
        model_id = f"model-{m}"
        seq = 0
        for _ in range(ready // models):
            subs.append(Submission(model_id, "forward_backward", {**shared, "seq": seq}, seq_id=seq))
            seq += 1
        subs.append(Submission(model_id, "optim_step", {"adam_params": {"learning_rate": 1e-4}}, seq_id=seq))
        seq += 1
        for _ in range(parked // models - 1):
            subs.append(Submission(model_id, "forward_backward", {**shared, "seq": seq}, seq_id=seq))
            seq += 1
    return subs


class StoreTarget:
    """The store in this process, behind the same group committer, DB thread and waiter the actor uses."""

    def __init__(self, path: Path, poller: str) -> None:
        self.store = FuturesStore(path)
        self.db = ThreadPoolExecutor(max_workers=1)
        self.committer = GroupCommitter(lambda group: self._run(self.store.submit_many, group))
        self.waiter = FutureWaiter(lambda ids: self._run(self.store.states, ids))
        self.poller = poller

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db, function, *args)

    async def submit(self, sub: Submission) -> int:
        return (await self.committer.submit(sub)).request_id

    async def timed_scan(self, load: bool) -> float:
        """Seconds the scheduler's work takes on the writer's thread: scan, barrier logic, payloads if asked."""
        def work() -> float:
            started = time.perf_counter()
            ready = dispatchable(self.store.scan_pending(), ordered=True)
            if load:
                payloads = self.store.load_payloads([meta.request_id for meta in ready], arrays=True)
                assert len(payloads) == len(ready)
            return time.perf_counter() - started
        return await self._run(work)

    async def scan(self):
        return await self._run(self.store.scan_pending)

    async def complete(self, completions):
        return await self._run(self.store.complete_many, completions)

    async def wait(self, request_id: int, timeout_s: float) -> None:
        if self.poller == "shared":
            try:
                await self.waiter.wait(request_id, timeout_s)
            except TimeoutError:
                pass
            return
        deadline = time.monotonic() + timeout_s  # the peer's old way: every caller polls its own id
        while time.monotonic() < deadline:
            state = (await self._run(self.store.states, [request_id])).get(request_id)
            if state is not None and state.finished:
                return
            await asyncio.sleep(PER_CALLER_POLL_S)

    async def counters(self) -> dict[str, Any]:
        db_mb, wal_mb = self.store.file_sizes_mb()
        return {"statements": self.store.statements, "commits": self.store.commits, "db_mb": db_mb, "wal_mb": wal_mb}

    async def close(self) -> None:
        await self.waiter.close()
        self.db.shutdown()
        self.store.close()


class ActorTarget:
    """The futures DB actor on a private, loopback-only Ray instance started by this benchmark."""

    def __init__(self, path: Path, temp_dir: Path) -> None:
        from cluster.local import prepare_environment

        prepare_environment()
        import ray

        from cluster.futures_actor import get_futures_actor

        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp_dir), log_to_driver=False,
                 _node_ip_address="127.0.0.1", namespace="lilo-bench")
        self.ray = ray
        self.actor = get_futures_actor(str(path), name="lilo-futures-bench")
        ray.get(self.actor.stats.remote())

    async def submit(self, sub: Submission) -> int:
        return await self.actor.submit.remote(sub)

    async def timed_scan(self, load: bool) -> float:
        """Seconds for a caller of the actor: scan and barrier logic, payloads if asked (Ray round trips included)."""
        started = time.perf_counter()
        ready = dispatchable(await self.actor.scan_pending.remote(), ordered=True)
        if load:
            payloads = await self.actor.load_payloads.remote([meta.request_id for meta in ready])
            assert len(payloads) == len(ready)
        return time.perf_counter() - started

    async def scan(self):
        return await self.actor.scan_pending.remote()

    async def complete(self, completions):
        return await self.actor.complete.remote(completions)

    async def wait(self, request_id: int, timeout_s: float) -> None:
        await self.actor.retrieve.remote(request_id, timeout_s)

    async def counters(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    async def close(self) -> None:
        self.ray.kill(self.actor)
        self.ray.shutdown()


async def run(target, args) -> dict[str, Any]:
    subs = workload(args.models, args.requests, args.blocked_requests)
    order = list(range(len(subs)))
    latencies: list[float] = []
    ids: dict[int, int] = {}

    async def submitter(worker: int) -> None:
        for i in order[worker::args.concurrency]:
            started = time.perf_counter()
            # Encoding happens where the request is decoded (an ingress replica), not on the one writer.
            ids[i] = await target.submit(subs[i].prepared())
            latencies.append(time.perf_counter() - started)

    phase: dict[str, dict[str, int]] = {}

    async def measured(name: str, work):
        before = await target.counters()
        started = time.perf_counter()
        result = await work
        elapsed = time.perf_counter() - started
        after = await target.counters()
        phase[name] = {"statements": after["statements"] - before["statements"],
                       "commits": after["commits"] - before["commits"]}
        return result, elapsed

    _, submit_s = await measured("submit", asyncio.gather(*(submitter(w) for w in range(args.concurrency))))

    async def scans(load: bool) -> list[float]:
        return [await target.timed_scan(load) for _ in range(SCAN_REPEATS)]

    parked_times, _ = await measured("scan_parked", scans(load=False))
    ready_times, _ = await measured("scan_ready", scans(load=True))

    pending_ids = [ids[i] for i in range(len(subs))]
    ready_ids = {meta.request_id for meta in dispatchable(await target.scan())}
    to_complete = [request_id for request_id in pending_ids if request_id in ready_ids]
    still_pending = [request_id for request_id in pending_ids if request_id not in ready_ids][:args.await_waiters]

    async def complete_all() -> None:
        result = orjson.dumps({"loss_fn_outputs": [{"logprobs": [0.0] * TOKENS}] * SEQUENCES, "metrics": {}})
        for start in range(0, len(to_complete), 64):
            await target.complete([Completion.success(r, result) for r in to_complete[start:start + 64]])

    _, complete_s = await measured("complete", complete_all())
    _, await_s = await measured("await", asyncio.gather(*(target.wait(r, AWAIT_S) for r in still_pending)))
    sizes = await target.counters()
    latencies.sort()
    return {
        "submit_ops": round(len(subs) / submit_s, 1),
        "submit_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "scan_parked_p50_ms": round(1000 * statistics.median(parked_times), 2),
        "scan_ready_p50_ms": round(1000 * statistics.median(ready_times), 1),
        "complete_s": round(complete_s, 3),
        "await_stmt_per_s": round(phase["await"]["statements"] / await_s, 1),
        "db_mb": round(sizes["db_mb"], 1),
        "wal_mb": round(sizes["wal_mb"], 1),
        "requests": len(subs),
        "waiters": len(still_pending),
        "phases": phase,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["store", "actor"], default="store")
    parser.add_argument("--poller", choices=["shared", "per-caller"], default="shared",
                        help="how waiters poll (store target only): one shared batched poller, or each its own")
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--requests", type=int, default=512, help="dispatchable requests")
    parser.add_argument("--blocked-requests", type=int, default=512, help="requests parked behind barriers")
    parser.add_argument("--await-waiters", type=int, default=512)
    args = parser.parse_args()
    if args.target == "actor" and args.poller != "shared":
        parser.error("--poller per-caller exists only for --target store; the actor always uses the shared poller")

    work_dir = Path(tempfile.mkdtemp(prefix="lilo-bf-", dir="/tmp"))
    try:
        if args.target == "store":
            target = StoreTarget(work_dir / "futures.db", args.poller)
        else:
            target = ActorTarget(work_dir / "futures.db", work_dir / "ray")

        async def go():
            try:
                return await run(target, args)
            finally:
                await target.close()

        result = asyncio.run(go())
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps({"bench": "futures", "target": args.target, "poller": args.poller, **result}))


if __name__ == "__main__":
    main()
