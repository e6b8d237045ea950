"""Where one SDK client's operations spend the service's CPU: py-spy samples each part of a private lilo (the
ingress replica, the futures DB actor, the trainer, Serve's proxy) and the client itself while the client steps
its adapter (forward_backward + optim_step of ``--rows`` x ``--seq`` tokens) for ``--seconds``.

Prints, per part, its CPU cores (``cpu_split``; ``cpu_ms_per_op``: CPU ms a part spends per operation;
``cpu_cores_idle``: 5 s before the client starts, what the cluster burns by itself) and the functions holding most
of its samples (self time, and the deepest frames of lilo's own code, libraries below them included), then one
JSON line:
{"bench": "profile_service", "step_p50_ms": .., "ops_per_s": .., "cpu_cores": {...}, "cpu_ms_per_op": {...},
 "cpu_cores_idle": {...},
 "top": {part: {"self": [[function, share], ...], "ours": [...]}}}.
Needs py-spy (``pip install py-spy``) and permission to read other processes (root, or ptrace).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench_service import client_loop
from cpu_split import CpuSplit, part_of
from private_cluster import private_cluster

API_KEY = "tml-bench-profile"
VOCAB = 1000  # the tiny Llama's
PARTS = ("ingress", "futures", "trainer", "proxy", "clients")


def cluster_pids(home: Path) -> dict[str, int]:
    """The process of each part of the cluster in ``home`` (the busiest, where a part has several)."""
    from cluster.local import cluster_processes, read_state
    from lilo.settings import Settings

    settings = Settings(home=home)
    found: dict[str, tuple[float, int]] = {}
    for process in cluster_processes(settings, read_state(settings).pid):
        part = part_of(process)
        if part in PARTS:
            busy = sum(process.cpu_times()[:2])
            if part not in found or busy > found[part][0]:
                found[part] = (busy, process.pid)
    found["clients"] = (0.0, os.getpid())
    return {part: pid for part, (_, pid) in found.items()}


# A frame of lilo's own code: py-spy writes "function (path:line)", the path relative to its sys.path entry.
OURS = re.compile(r"\((lilo|serve|cluster)/")


def summarize(raw: Path, top: int) -> dict[str, list[tuple[str, float]]]:
    """From a py-spy raw (collapsed stacks) file: the ``top`` functions by self samples (``self``), and by samples
    under the deepest frame of lilo's own code in each stack (``ours``: where lilo's code led the time, the
    libraries it called included), each with its share of all samples."""
    own: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        own[frames[-1]] += int(count)
        mine = [frame for frame in frames if OURS.search(frame)]
        ours[mine[-1] if mine else "(outside lilo's code)"] += int(count)
        total += int(count)
    return {name: [(function, round(count / max(total, 1), 3)) for function, count in counter.most_common(top)]
            for name, counter in (("self", own), ("ours", ours))}


def py_spy() -> str:
    """py-spy's command: beside this Python (a virtual environment's), else on the PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--out", type=Path, default=None, help="keep the raw profiles here")
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker

    out = args.out or Path(tempfile.mkdtemp(prefix="lilo-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    with private_cluster("lilo/tiny-llama", args.port) as home:
        base_url = f"http://127.0.0.1:{args.port}"
        pids = cluster_pids(home)
        service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
        ready, go, stop, stepped = threading.Barrier(2), threading.Event(), threading.Event(), {}
        client = threading.Thread(target=client_loop, daemon=True, args=(
            service, "lilo/tiny-llama", args.rows, args.seq, VOCAB, ready, go, stop, stepped))
        idle = CpuSplit(home)
        idle.start()
        time.sleep(5)  # the cluster with no client: what it burns by itself
        idle_cores = idle.cores()
        client.start()
        ready.wait(timeout=600)  # its model made and warmed up
        go.set()
        cpu = CpuSplit(home)
        cpu.start()
        spies = {part: subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
                                         "--rate", str(args.rate), "--format", "raw", "--nonblocking",
                                         "--output", str(out / f"{part}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for part, pid in pids.items()}
        for spy in spies.values():
            spy.wait()
        cores = cpu.cores()
        stop.set()
        client.join(timeout=120)
        service.close("success").result()
    steps = stepped["steps"]
    top = {part: summarize(out / f"{part}.txt", args.top) for part in pids if (out / f"{part}.txt").exists()}
    for part, summaries in top.items():
        print(f"{part} ({cores.get(part, 0.0)} cores):")
        for name, functions in summaries.items():
            print(f"  by {name}:")
            for function, share in functions:
                print(f"    {share:6.1%}  {function}")
    measured = steps[len(steps) // 10:]
    ops_per_s = 2 * len(measured) / sum(measured)
    cpu_ms_per_op = {part: round(used * 1e3 / ops_per_s, 1) for part, used in cores.items()}
    print(json.dumps({"bench": "profile_service", "step_p50_ms": round(float(np.median(measured)) * 1e3, 1),
                      "ops_per_s": round(ops_per_s, 1), "cpu_cores": cores, "cpu_ms_per_op": cpu_ms_per_op,
                      "cpu_cores_idle": idle_cores, "top": top, "profiles": str(out)}))


if __name__ == "__main__":
    main()
