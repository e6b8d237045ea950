"""A private local lilo for a benchmark: its own temp home, loopback only, stopped and removed when the benchmark
ends."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

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


@contextlib.contextmanager
def futures_actor_of(home: Path) -> Iterator[Any]:
    """The futures DB actor of the private cluster in ``home``, this process connected to it as a Ray driver (call
    ``cluster.local.prepare_environment`` before Ray is first imported)."""
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE, connect_driver
    from lilo.settings import load_settings

    connect_driver(load_settings(home=home))
    try:
        yield ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    finally:
        ray.shutdown()
