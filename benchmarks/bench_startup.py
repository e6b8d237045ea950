"""Startup cost of the local cluster: time until healthz answers, time to stop, summed RSS of its processes.

Runs the real `lilo up --detach` / `lilo down` on free loopback ports in a fresh home and prints one JSON line:
{"bench": "startup", "up_s": .., "down_s": .., "rss_mb": .., "uss_mb": .., "processes": .., "leftovers": ..}
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.local import cluster_processes, prepare_environment, read_state
from cluster.ports import free_ports
from lilo.backend.registry import DEFAULT_BASE_MODEL
from lilo.settings import load_settings
from serve.deploy import healthz

LILO = str(Path(sys.executable).parent / "lilo")


def measure(num_cpus: int | None, base_model: str) -> dict:
    home = Path(tempfile.mkdtemp(prefix="lilo-b-", dir="/tmp"))
    http_port, dashboard_port = free_ports(2)
    settings = load_settings(env={}, home=home, http_port=http_port, dashboard_port=dashboard_port, num_cpus=num_cpus)
    args = ["--home", str(home), "--port", str(settings.http_port), "--dashboard-port", str(settings.dashboard_port),
            "--base-model", base_model]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    try:
        started = time.monotonic()
        up = subprocess.Popen([LILO, "up", "--detach", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while not healthz(settings.api_url, timeout_s=1.0):
            if up.poll() not in (None, 0):
                raise SystemExit(f"lilo up failed:\n{up.stdout.read().decode()}")
            time.sleep(0.05)
        up_s = time.monotonic() - started
        up.wait(timeout=60)
        processes = cluster_processes(settings, read_state(settings).pid)
        rss_mb = sum(p.memory_info().rss for p in processes) / 2**20
        # RSS counts pages shared between Ray's many Python processes once per process; USS counts them none.
        uss_mb = sum(p.memory_full_info().uss for p in processes) / 2**20

        started = time.monotonic()
        subprocess.run([LILO, "down", "--home", str(home)], check=True, capture_output=True)
        down_s = time.monotonic() - started
        leftovers = cluster_processes(settings, None)
        return {"up_s": up_s, "down_s": down_s, "rss_mb": rss_mb, "uss_mb": uss_mb, "processes": len(processes),
                "leftovers": len(leftovers)}
    finally:
        subprocess.run([LILO, "down", "--home", str(home)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-cpus", type=int, help="CPUs the Ray head offers (default: all)")
    parser.add_argument("--base-model", default=DEFAULT_BASE_MODEL, help="what the trainer loads (cached after once)")
    args = parser.parse_args()
    prepare_environment()  # the environment `lilo up` gives Ray, for the clusters this starts
    result = measure(args.num_cpus, args.base_model)
    rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps({"bench": "startup", "base_model": args.base_model, **rounded}))


if __name__ == "__main__":
    main()
