"""One session-scoped local cluster, started and stopped with the real `lilo` command."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from cluster.local import connect_driver, prepare_environment

# Before anything imports Ray: every Ray process a test starts stays on loopback, and drivers speak the token auth.
prepare_environment()

import pytest  # noqa: E402 (after prepare_environment, on purpose)

from benchmarks.postgres_server import NO_FSYNC, PostgresServer, postgres_server  # noqa: E402
from cluster.ports import free_ports  # noqa: E402
from helpers import Clock, lilo, lilo_down, short_home  # noqa: E402
from lilo.settings import load_settings  # noqa: E402
from lilo.timing.traces import TRACES_ENDPOINT  # noqa: E402
from benchmarks.otlp_receiver import OtlpReceiver  # noqa: E402

# The registered tiny model, and a second one served from a local directory (built in local_cluster): a tiny
# Llama with SmolLM2's vocabulary and chat tokenizer, so the demo runs on it too.
TINY_DIRECTORY = Path(tempfile.gettempdir()) / f"lilo-tiny-dir-{os.getpid()}"
BASE_MODELS = ("lilo/tiny-llama", str(TINY_DIRECTORY))
# The session cluster's trainers of this base model span two ranks (its decoder sharded over two processes): every
# test on it (the cookbook's recipes, the OpenAI API, sampling, paging) runs on a sharded trainer.
SHARDED_BASE_MODEL = str(TINY_DIRECTORY)
# The session cluster runs with API keys: the tests' and the demo's keys are the tenant "local" (so they work as in
# local mode), and two more tenants try each other's things (test_tenants.py). Local mode itself is tested without
# a cluster (test_api_key_gate.py) and by the two-node cluster (test_two_nodes.py), which runs without keys.
TENANT_KEYS = {"alpha": "tml-tenant-alpha", "beta": "tml-tenant-beta"}
API_KEYS_FILE = "\n".join(["# key=tenant", "tml-local-test=local", "tml-local-demo=local",
                           *(f"{key}={tenant}" for tenant, key in TENANT_KEYS.items())]) + "\n"


@dataclasses.dataclass(frozen=True)
class RunningCluster:
    home: Path
    http_port: int
    dashboard_port: int
    base_models: tuple[str, ...]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def settings(self):
        return load_settings(env={}, home=self.home, http_port=self.http_port, dashboard_port=self.dashboard_port)


@pytest.fixture(scope="session")
def trace_receiver() -> Iterator[OtlpReceiver]:
    """Where the session cluster exports its traces (so every test runs with traces on; see test_traces.py)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def local_cluster(trace_receiver: OtlpReceiver) -> Iterator[RunningCluster]:
    from transformers import AutoTokenizer

    from lilo.backend.models import build_tiny_llama, smollm2_directory

    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory())
    build_tiny_llama(TINY_DIRECTORY, seed=1, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(TINY_DIRECTORY)
    cluster = RunningCluster(short_home(), *free_ports(2), BASE_MODELS)
    keys_file = cluster.home / "api-keys"
    keys_file.write_text(API_KEYS_FILE)
    args = ["up", "--detach", "--home", str(cluster.home), "--port", str(cluster.http_port),
            "--dashboard-port", str(cluster.dashboard_port), "--num-cpus", "10", "--trainers", "2",
            "--trainer-ranks", f"1,{SHARDED_BASE_MODEL}=2",
            "--api-keys-file", str(keys_file),
            # Few tests unload their models, and a restarted recovery actor restores the ones tests placed on
            # trainers that never existed: room for all of them, whichever test runs when.
            "--max-adapters", "48",
            # Every SDK client of the suite then zstd-compresses its forward_backward bodies (on loopback "auto"
            # would not ask it to), so the whole suite runs through the server's inflating of them.
            "--compress-bodies", "always"]
    for name in cluster.base_models:
        args += ["--base-model", name]
    started = lilo(*args, env={TRACES_ENDPOINT: trace_receiver.endpoint})
    if started.returncode != 0:
        lilo("down", "--home", str(cluster.home))
        pytest.fail(f"lilo up failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield cluster
    finally:
        try:
            lilo_down(cluster.home)
        finally:
            shutil.rmtree(cluster.home, ignore_errors=True)
            shutil.rmtree(TINY_DIRECTORY, ignore_errors=True)


def pytest_collection_modifyitems(items: list) -> None:
    """Tests that kill parts of the session cluster run last, so a fault they cause (and its recovery) never
    overlaps another test's work."""
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


@pytest.fixture(autouse=True)
def no_sdk_telemetry(monkeypatch):
    """The SDK's telemetry would post to the service under test; keep it out of every test."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture
def service(local_cluster: RunningCluster):
    """An SDK client of the session cluster."""
    import tinker

    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as client:
        yield client


@pytest.fixture(scope="session")
def ray_driver(local_cluster: RunningCluster) -> Iterator[None]:
    """This test process, connected to the session cluster as a Ray driver."""
    import ray

    connect_driver(local_cluster.settings)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A real tiny Llama, written with from_pretrained's files (the library tests load it back as ``base``)."""
    from lilo.backend.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def base(tiny_dir: Path):
    from lilo.backend.models import load_base_model

    return load_base_model(tiny_dir)


@pytest.fixture
def clock() -> Clock:
    """A hand-driven clock (starts at t=100 s)."""
    return Clock()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the session's ledger tests, on loopback (benchmarks/postgres_server.py); it
    fails, naming the package to install, where PostgreSQL is not installed."""
    with postgres_server(NO_FSYNC) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request, tmp_path) -> str:
    """Where a test's futures ledger lives: a new SQLite file, or a new database on the session's PostgreSQL
    server (``--ledger``). A test that pokes at SQLite itself takes ``SQLITE_ONLY``."""
    if request.param == "sqlite":
        return str(tmp_path / "db" / "futures.db")
    return request.getfixturevalue("postgres").create_database()

