"""Startup cost of the local cluster: time until it is ready, time to stop, summed RSS of its processes.

Runs the real `lilo up --detach` / `lilo down` on free loopback ports in a fresh home and prints one JSON line:
{"bench": "startup", "up_s": .., "down_s": .., "rss_mb": .., "uss_mb": .., "processes": .., "leftovers": ..,
 "phases": {..}}

``phases`` splits ``up_s`` by the supervisor's timestamped progress lines (what `lilo up` prints): ``launch_s`` the
command and the supervisor's own start, ``ray_up_s`` the Ray head, ``actors_s`` from Ray up to the trainers' start
(the timing and futures DB actors), ``trainers_s`` until every trainer has its base model loaded (of which
``trainer_backend_ready_s`` inside the trainer's process, where `lilo up` says), ``serve_deploy_s`` from the Serve
app's deploy until healthz answers, ``healthz_s`` from when the supervisor starts waiting on healthz. Spans that run
at the same time overlap, so they may sum to more than ``up_s``.
"""

from __future__ import annotations

import argparse
import json
import re
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
# "[lilo  12.3s] message": a progress line of the supervisor, seconds since it started.
PROGRESS = re.compile(r"^\[lilo +([0-9.]+)s\] (.*)$")
BACKEND_READY = re.compile(r"base model loaded ([0-9.]+) s after its process started")
# Each phase: the progress lines that start and end it (their first words, which `lilo up` has printed alike since
# before the phases were measured, so an older checkout splits its start the same way).
PHASES = {
    "ray_up_s": (None, "Ray is up"),
    "actors_s": ("Ray is up", "Starting trainers"),
    "trainers_s": ("Starting trainers", "Trainers ready"),
    "serve_deploy_s": ("Deploying the Serve application", None),
    "healthz_s": ("Waiting for", None),
}


def measure(num_cpus: int | None, base_model: str) -> dict:
    home = Path(tempfile.mkdtemp(prefix="lilo-b-", dir="/tmp"))
    http_port, dashboard_port = free_ports(2)
    settings = load_settings(env={}, home=home, http_port=http_port, dashboard_port=dashboard_port, num_cpus=num_cpus)
    args = ["--home", str(home), "--port", str(settings.http_port), "--dashboard-port", str(settings.dashboard_port),
            "--base-model", base_model]
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    try:
        started, started_at = time.monotonic(), time.time()
        up = subprocess.Popen([LILO, "up", "--detach", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        healthy_s = None
        # Up: healthz answers and the supervisor says it is ready (its trainers loaded), which may come later.
        while healthy_s is None or (state := read_state(settings)) is None or state.status != "ready":
            if up.poll() not in (None, 0):
                raise SystemExit(f"lilo up failed:\n{up.stdout.read().decode()}")
            if healthy_s is None and healthz(settings.api_url, timeout_s=1.0):
                healthy_s = time.monotonic() - started
            time.sleep(0.05)
        up_s = time.monotonic() - started
        up.wait(timeout=60)
        launch_s = state.started_at - started_at
        phases = startup_phases(up.stdout.read().decode(errors="replace").splitlines(), launch_s,
                                healthy_s - launch_s)
        processes = cluster_processes(settings, state.pid)
        rss_mb = sum(p.memory_info().rss for p in processes) / 2**20
        # RSS counts pages shared between Ray's many Python processes once per process; USS counts them none.
        uss_mb = sum(p.memory_full_info().uss for p in processes) / 2**20

        started = time.monotonic()
        subprocess.run([LILO, "down", "--home", str(home)], check=True, capture_output=True)
        down_s = time.monotonic() - started
        leftovers = cluster_processes(settings, None)
        return {"up_s": up_s, "down_s": down_s, "rss_mb": rss_mb, "uss_mb": uss_mb, "processes": len(processes),
                "leftovers": len(leftovers), "phases": phases}
    finally:
        subprocess.run([LILO, "down", "--home", str(home)], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def startup_phases(lines: list[str], launch_s: float, healthy_s: float) -> dict[str, float]:
    """``PHASES`` from the output of `lilo up --detach`, in seconds. ``launch_s``: how long after this run's start
    the supervisor's clock started (the command, the detach, the supervisor's imports); ``healthy_s``: when
    healthz first answered, on that clock."""
    stamps: dict[str, float] = {}
    for line in lines:
        if progress := PROGRESS.match(line):
            # An older checkout announced the deploy at the end of the trainers' line: "...; deploying the ...".
            for message in progress[2].split("; "):
                stamps.setdefault(message[:1].upper() + message[1:], float(progress[1]))

    def stamp(first_words: str | None, unnamed_s: float) -> float | None:
        if first_words is None:
            return unnamed_s
        return next((seconds for message, seconds in stamps.items() if message.startswith(first_words)), None)

    phases = {"launch_s": launch_s}
    if loaded := [float(seconds) for line in lines for seconds in BACKEND_READY.findall(line)]:
        phases["trainer_backend_ready_s"] = max(loaded)
    for name, (start, end) in PHASES.items():
        begin, finish = stamp(start, 0.0), stamp(end, healthy_s)
        if begin is not None and finish is not None:
            # Healthz may answer before the supervisor waits on it (the Serve app deploys while trainers load).
            phases[name] = max(0.0, finish - begin)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-cpus", type=int, help="CPUs the Ray head offers (default: all)")
    parser.add_argument("--base-model", default=DEFAULT_BASE_MODEL, help="what the trainer loads (cached after once)")
    args = parser.parse_args()
    prepare_environment()  # the environment `lilo up` gives Ray, for the clusters this starts
    result = measure(args.num_cpus, args.base_model)
    rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
    rounded["phases"] = {k: round(v, 2) for k, v in result["phases"].items()}
    print(json.dumps({"bench": "startup", "base_model": args.base_model, **rounded}))


if __name__ == "__main__":
    main()
