"""A private local lilo for a benchmark: its own temp home, loopback only, stopped and removed when the benchmark
ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from cluster.ports import free_ports


def lilo(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "serve.cli", *args], check=True, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def private_cluster(base_model: str, port: int, *up_args: str) -> Iterator[Path]:
    """``lilo up`` serving ``base_model`` on 127.0.0.1:``port`` (its dashboard on a free port); yields its home."""
    home = Path(tempfile.mkdtemp(prefix="lilo-bench-", dir="/tmp"))
    lilo("up", "--detach", "--home", str(home), "--port", str(port), "--dashboard-port", str(free_ports(1)[0]),
         "--base-model", base_model, *up_args)
    try:
        yield home
    finally:
        lilo("down", "--home", str(home))
        shutil.rmtree(home, ignore_errors=True)
