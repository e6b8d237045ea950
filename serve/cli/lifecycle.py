"""`lilo up` and `lilo down`: `lilo up` runs a supervisor in the foreground (Ctrl-C stops everything it started);
`lilo up --detach` runs the same supervisor in the background, shows its progress until the service answers, and
returns; `lilo down` stops it and every process it started, passing on what its shutdown reported."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from cluster.local import ClusterError, ClusterState, check_ports_free, read_state, running_state, stop_cluster
from cluster.service import AlreadySupervised, ServeApp, stop_wait_s, supervise
from lilo.settings import Settings
from serve.cli.options import DETACHED_CHILD_FLAG, EXIT_FAILED, EXIT_OK, settings_of


# The last line of the ready banner of a detached supervisor, and how long `lilo up --detach` waits for it.
DETACHED_STOP_HINT = "Stop it with `lilo down`."
BANNER_WAIT_S = 10.0


class Progress:
    """Timestamped progress lines, flushed at once so a follower of the log sees them as they happen."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def __call__(self, message: str) -> None:
        print(f"[lilo {self.elapsed_s:5.1f}s] {message}", flush=True)


def _already_running_message(state: ClusterState) -> str:
    return (
        f"lilo is already running at {state.api_url} (pid {state.pid}, home {state.home}).\n"
        "Use it as it is, or stop it first with `lilo down`."
    )


def _print_ready(settings: Settings, startup_s: float, detached: bool) -> None:
    print(f"\nlilo is ready in {startup_s:.1f} s", flush=True)
    print(f"  Tinker API:  {settings.api_url}   (TINKER_BASE_URL={settings.api_url})", flush=True)
    if settings.ray_address is None:
        print(f"  Dashboard:   {settings.dashboard_url}", flush=True)
    print(f"  Home:        {settings.home}", flush=True)
    if settings.local_mode:
        print("  API keys:    local mode: any key starting with tml- (e.g. TINKER_API_KEY=tml-local)", flush=True)
    else:
        digests = settings.api_key_digests()
        print(f"  API keys:    {len(digests)} configured, {len(set(digests.values()))} tenant(s)", flush=True)
    stop_hint = DETACHED_STOP_HINT if detached else "Press Ctrl-C to stop."
    print(stop_hint, flush=True)


def _serve_app() -> ServeApp:
    """The Serve application's deployment, for the supervisor to call once Ray is up: importing it takes seconds."""
    import serve.deploy

    return serve.deploy


def _supervise(settings: Settings, detached: bool) -> int:
    """Run the service in this process (``cluster.service.supervise``), printing its progress and its banner."""
    progress = Progress()
    try:
        stopped = supervise(settings, _serve_app, progress,
                            on_ready=lambda: _print_ready(settings, progress.elapsed_s, detached))
    except AlreadySupervised as busy:
        starting = f"Another lilo is starting under {settings.home}."
        print(_already_running_message(busy.state) if busy.state else starting)
        return EXIT_FAILED
    return EXIT_OK if stopped else EXIT_FAILED


def _follow(path: Path) -> Iterator[str]:
    """Lines appended to ``path``, as they come; yields '' whenever there is nothing new."""
    offset, pending = 0, ""
    while True:
        with open(path) as log:
            log.seek(offset)
            chunk = log.read()
            offset = log.tell()
        pending += chunk
        *lines, pending = pending.split("\n")
        yield from lines
        if not lines:
            yield ""


def _progress_lines_since(log_file: Path, offset: int) -> list[str]:
    """The supervisor's progress lines (not Ray's) written to ``log_file`` after ``offset``."""
    if not log_file.exists():
        return []
    with open(log_file, errors="replace") as log:
        log.seek(offset)
        return [line for line in log.read().splitlines() if line.startswith("[lilo ")]


def up_detached(settings: Settings, argv: Sequence[str]) -> int:
    """Run the supervisor in the background, echo its progress until it is ready or fails, and return."""
    settings.home.mkdir(parents=True, exist_ok=True)
    child_argv = [arg for arg in argv if arg != "--detach"] + [DETACHED_CHILD_FLAG]
    with open(settings.log_file, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", *child_argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + settings.startup_timeout_s + 60
    banner_deadline = None
    for line in _follow(settings.log_file):
        if line:
            print(line, flush=True)
            if line == DETACHED_STOP_HINT:  # the ready banner's last line
                return EXIT_OK
            continue
        state = read_state(settings)
        if state is not None and state.pid == child.pid and state.status == "ready":
            # The ready banner is printed right after the state is written (on a loaded machine it may take a
            # while to land): wait for it, but not forever.
            banner_deadline = banner_deadline or time.monotonic() + BANNER_WAIT_S
            if time.monotonic() > banner_deadline:
                return EXIT_OK
        if child.poll() is not None:
            print(f"lilo up failed (exit {child.returncode}); full log: {settings.log_file}", flush=True)
            return EXIT_FAILED
        if time.monotonic() > deadline:
            print(f"lilo up did not become ready in time; stopping it. Full log: {settings.log_file}", flush=True)
            stop_cluster(settings, child.pid)
            return EXIT_FAILED
        time.sleep(0.1)
    return EXIT_FAILED


def cmd_up(args: argparse.Namespace, argv: Sequence[str]) -> int:
    settings = settings_of(args)
    settings.api_key_digests()  # a malformed keys file is refused here, before anything starts
    state = running_state(settings)
    if state is not None:
        print(_already_running_message(state))
        return EXIT_FAILED
    if args.detach:
        # Refuse here, before a background process exists; the supervisor checks again under its lock.
        try:
            check_ports_free(settings)
        except ClusterError as error:
            print(f"error: {error}")
            return EXIT_FAILED
        return up_detached(settings, argv)
    return _supervise(settings, detached=args.detached_child)


def cmd_down(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    state = running_state(settings)
    started = time.monotonic()
    if state is None:
        strays = stop_cluster(settings, None)
        print(f"No lilo cluster is running under {settings.home}; nothing to stop.")
        if strays:
            print(f"Killed {len(strays)} leftover process(es) of an earlier cluster that was not stopped: {strays}")
        return EXIT_OK
    print(f"Stopping lilo (pid {state.pid}) and every process it started...", flush=True)
    log_size = settings.log_file.stat().st_size if settings.log_file.exists() else 0
    timeout_s = args.timeout if args.timeout is not None else stop_wait_s(state)
    killed = stop_cluster(settings, state.pid, timeout_s=timeout_s)
    # A detached supervisor reports its shutdown (the models it saved) to its log: pass that on.
    for line in _progress_lines_since(settings.log_file, log_size):
        print(line, flush=True)
    if killed:
        print(f"Killed {len(killed)} process(es) that did not stop within {timeout_s:.0f} s: {killed}")
    print(f"Stopped in {time.monotonic() - started:.1f} s.")
    return EXIT_OK
