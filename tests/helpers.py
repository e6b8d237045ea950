"""Shared test helpers: run the real `lilo` console script, pick free loopback ports, inspect a cluster."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

LILO = str(Path(sys.executable).parent / "lilo")
LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def short_home() -> Path:
    """A fresh cluster home short enough for Ray's unix socket paths (pytest's tmp_path is too long)."""
    return Path(tempfile.mkdtemp(prefix="lilo-t-", dir="/tmp"))


def lilo(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([LILO, *args], capture_output=True, text=True, timeout=timeout_s)


def tcp_listeners(processes: list[psutil.Process]) -> list[tuple[str, int, str]]:
    """(ip, port, process name) of every TCP socket in LISTEN state held by these processes."""
    names = {p.pid: p.name() for p in processes}
    return [
        (conn.laddr.ip, conn.laddr.port, names[conn.pid])
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in names
    ]


class Clock:
    """A clock a test moves by hand: ``clock.now += 5``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
