"""The futures ledger under the seed's load shape, in-process (``--target store``) or through the Ray actor.

Defaults: 16 models, 128 concurrent submitters, 1,024 forward_backward requests of ~76 KiB of JSON each (4
sequences x 512 tokens with targets and weights), then 512 waiters parked on futures still pending. What the service
does with each: submit (the fingerprint is computed where the request is decoded, as an ingress does, and only
metadata and the fingerprint are written, in group commits); complete (every result, in batches of 64, as trainers
write them); await (the waiters parked for a while: SQL statements per second, one batched query per tick whatever
their number). SQL statements and commits are counted per phase. Prints one JSON line:
{"bench": "futures", "target": .., "submit_ops": .., "submit_p99_ms": .., "complete_ops": .., "await_stmt_per_s": ..,
 "db_mb": .., "wal_mb": .., "checkpointed_mb": .., ...}
db_mb and wal_mb are the two files as the run leaves them (SQLite folds the log into the file every 1,000 pages of
16 KiB); checkpointed_mb (store target) is their size once the log is folded in: what the ledger holds.
Targets on a 2-core machine: submit >= 4,000 op/s with p99 <= 50 ms at 128 submitters, db_mb <= 10 for 1,024
requests.

``--ledger postgresql`` runs it on a PostgreSQL database instead (a server this benchmark starts on loopback with
PostgreSQL's default settings, benchmarks/postgres_server.py): db_mb is then the whole database (with its empty
catalogs, about 7.5 MB), wal_mb 0, and checkpointed_mb the ledger's tables with their indexes. ``--ledger both``
runs both and prints their figures side by side in one line: {"bench": "futures", .., "ledger": "both",
"sqlite": {..}, "postgresql": {..}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from postgres_server import postgres_server
from sqlalchemy import text

from lilo.futures.group_commit import GroupCommitter
from lilo.futures.store import Completion, FuturesStore, Submission
from lilo.futures.waiter import FutureWaiter

SEQUENCES, TOKENS = 4, 512
COMPLETION_BATCH = 64
AWAIT_S = 3.0
PER_CALLER_POLL_S = 0.1


def payload(rng: random.Random) -> dict:
    datum = lambda: {  # noqa: E731
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [rng.randrange(49152) for _ in range(TOKENS)]}]},
        "loss_fn_inputs": {"target_tokens": [rng.randrange(49152) for _ in range(TOKENS)],
                           "weights": [rng.random() for _ in range(TOKENS)]},
    }
    return {"forward_backward_input": {"data": [datum() for _ in range(SEQUENCES)], "loss_fn": "cross_entropy"}}


def workload(models: int, requests: int, seed: int = 0) -> list[Submission]:
    """``requests`` forward_backwards dealt over ``models`` in seq order, each with its own ~76 KiB payload."""
    rng = random.Random(seed)
    shared = payload(rng)  # one body reused: each copy is still encoded and hashed on its own
    per_model = requests // models
    return [Submission(f"model-{m}", "forward_backward", {**shared, "seq": seq}, seq_id=seq)
            for m in range(models) for seq in range(per_model)]


class StoreTarget:
    """The store in this process, behind the same group committer, DB thread and waiter the actor uses."""

    def __init__(self, ledger: str, poller: str) -> None:
        self.store = FuturesStore(ledger)
        self.db = ThreadPoolExecutor(max_workers=1)
        self.committer = GroupCommitter(lambda group: self._run(self.store.submit_many, group))
        self.waiter = FutureWaiter(lambda ids: self._run(self.store.states, ids))
        self.poller = poller

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db, function, *args)

    async def submit(self, sub: Submission) -> int:
        return (await self.committer.submit(sub)).request_id

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

    async def checkpointed_mb(self) -> float:
        """The file's size once the write-ahead log is folded into it (what the ledger really holds); PostgreSQL:
        the size of the ledger's tables and indexes."""
        def fold() -> float:
            with self.store.engine.connect() as connection:
                if self.store.path is None:
                    return round(float(connection.execute(text(_TABLES_SIZE)).scalar_one()) / 2**20, 2)
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            return round(sum(self.store.file_sizes_mb()), 2)
        return await self._run(fold)

    async def close(self) -> None:
        await self.waiter.close()
        self.db.shutdown()
        self.store.close()


class ActorTarget:
    """The futures DB actor on a private, loopback-only Ray instance started by this benchmark."""

    def __init__(self, ledger: str, temp_dir: Path) -> None:
        from cluster.local import prepare_environment

        prepare_environment()
        import ray

        from cluster.futures_actor import get_futures_actor

        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp_dir), log_to_driver=False,
                 _node_ip_address="127.0.0.1", namespace="lilo-bench")
        self.ray = ray
        self.actor = get_futures_actor(ledger, name="lilo-futures-bench")
        ray.get(self.actor.stats.remote())

    async def submit(self, sub: Submission) -> int:
        return await self.actor.submit.remote(sub)

    async def complete(self, completions):
        return await self.actor.complete.remote(completions)

    async def wait(self, request_id: int, timeout_s: float) -> None:
        await self.actor.retrieve.remote(request_id, timeout_s)

    async def counters(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    async def checkpointed_mb(self) -> None:
        return None  # the actor checkpoints on its own schedule (after pruning)

    async def close(self) -> None:
        self.ray.kill(self.actor)
        self.ray.shutdown()


_TABLES_SIZE = "SELECT SUM(pg_total_relation_size(quote_ident(tablename))) FROM pg_tables WHERE schemaname = 'public'"


async def run(target, args) -> dict[str, Any]:
    subs = workload(args.models, args.requests)
    latencies: list[float] = []
    ids: list[int] = []

    async def submitter(worker: int) -> None:
        for sub in subs[worker::args.concurrency]:
            started = time.perf_counter()
            ids.append(await target.submit(sub.prepared()))  # fingerprinted here, as an ingress replica does
            latencies.append(time.perf_counter() - started)

    phase: dict[str, dict[str, int]] = {}

    async def measured(name: str, work) -> float:
        before = await target.counters()
        started = time.perf_counter()
        await work
        elapsed = time.perf_counter() - started
        after = await target.counters()
        phase[name] = {"statements": after["statements"] - before["statements"],
                       "commits": after["commits"] - before["commits"]}
        return elapsed

    submit_s = await measured("submit", asyncio.gather(*(submitter(w) for w in range(args.concurrency))))
    ids.sort()
    waiting = ids[-args.await_waiters:]  # stay pending while the waiters park on them
    to_complete = ids[:len(ids) - len(waiting)]

    async def complete_all() -> None:
        result = orjson.dumps({"loss_fn_outputs": [{"logprobs": [0.0] * TOKENS}] * SEQUENCES, "metrics": {}})
        for start in range(0, len(to_complete), COMPLETION_BATCH):
            await target.complete([Completion.success(r, result) for r in to_complete[start:start + COMPLETION_BATCH]])

    complete_s = await measured("complete", complete_all())
    await_s = await measured("await", asyncio.gather(*(target.wait(r, AWAIT_S) for r in waiting)))
    sizes = await target.counters()
    latencies.sort()
    return {
        "submit_ops": round(len(subs) / submit_s, 1),
        "submit_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "complete_ops": round(len(to_complete) / complete_s, 1),
        "await_stmt_per_s": round(phase["await"]["statements"] / await_s, 1),
        "db_mb": round(sizes["db_mb"], 2),
        "wal_mb": round(sizes["wal_mb"], 2),
        "checkpointed_mb": await target.checkpointed_mb(),
        "requests": len(subs),
        "waiters": len(waiting),
        "phases": phase,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["store", "actor"], default="store")
    parser.add_argument("--poller", choices=["shared", "per-caller"], default="shared",
                        help="how waiters poll (store target only): one shared batched poller, or each its own")
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--await-waiters", type=int, default=512)
    parser.add_argument("--ledger", choices=["sqlite", "postgresql", "both"], default="sqlite",
                        help="where the ledger lives: a SQLite file, a PostgreSQL database this benchmark starts on "
                             "loopback, or each in turn")
    args = parser.parse_args()
    if args.target == "actor" and args.poller != "shared":
        parser.error("--poller per-caller exists only for --target store; the actor always uses the shared poller")

    ledgers = ["sqlite", "postgresql"] if args.ledger == "both" else [args.ledger]
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(postgres_server()) if "postgresql" in ledgers else None
        for ledger in ledgers:
            work_dir = Path(tempfile.mkdtemp(prefix="lilo-bf-", dir="/tmp"))
            try:
                location = str(work_dir / "futures.db") if ledger == "sqlite" else server.create_database()
                results[ledger] = measure(args, location, work_dir)
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
    head = {"bench": "futures", "target": args.target, "poller": args.poller, "ledger": args.ledger}
    print(json.dumps({**head, **(results if args.ledger == "both" else results[args.ledger])}))


def measure(args, ledger: str, work_dir: Path) -> dict[str, Any]:
    """The figures of one run on the ledger at ``ledger`` (a SQLite path or a PostgreSQL URL)."""
    target = StoreTarget(ledger, args.poller) if args.target == "store" else ActorTarget(ledger, work_dir / "ray")

    async def go():
        try:
            return await run(target, args)
        finally:
            await target.close()

    return asyncio.run(go())


if __name__ == "__main__":
    main()
