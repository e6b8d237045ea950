"""The private, loopback-only local Ray cluster behind `lilo up`: start it, find it, stop exactly it.

One supervisor process owns each local cluster. It starts the Ray head with ``ray.init`` (so every Ray process
of that cluster is its descendant), holds an exclusive lock on ``<home>/lock`` for as long as it lives, and
records where the cluster answers in ``<home>/cluster.json``. Stopping never uses ``ray stop``, which would kill
every Ray process on the machine: it signals that supervisor and then its own descendants only.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import psutil

from lilo.settings import Settings

# Ray reads these when it is imported. The first makes the node IP 127.0.0.1 and Ray's servers listen on loopback
# only; the second says outright that the cluster uses Ray's token authentication (the token lives in
# ~/.ray/auth_token), which every other driver that connects to it must say as well.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
# How long a starting head waits for its GCS server to bind (Ray's default, 30 s, passed on a busy 2-core machine
# whose disk cache was cold: the head failed to start); a value already in the environment wins.
GCS_PORT_WAIT_ENV = ("RAY_gcs_server_port_wait_time_s", "120")
NAMESPACE = "lilo"
# How long processes of a cluster may outlive its supervisor before `lilo down` kills them.
ORPHAN_GRACE_S = 5.0


class ClusterError(RuntimeError):
    """Something about the local cluster a user can act on; the message says what."""


@dataclasses.dataclass(frozen=True)
class ClusterState:
    """What `lilo up` records about a running cluster (``<home>/cluster.json``)."""

    pid: int
    status: str  # "starting" | "ready"
    home: str
    api_url: str
    dashboard_url: str
    gcs_address: str | None
    started_at: float
    # How long its trainers may take to save their models when it stops (``lilo down`` waits that much longer).
    stop_save_timeout_s: float = 40.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


class SupervisorLock:
    """The exclusive lock a supervisor holds for its lifetime; the OS drops it when the process dies."""

    def __init__(self, settings: Settings) -> None:
        self._path = settings.home / "lock"
        self._file: IO[str] | None = None

    def acquire(self) -> bool:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self._path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        return True

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def is_locked(settings: Settings) -> bool:
    """True while some supervisor holds this home's lock."""
    probe = SupervisorLock(settings)
    if probe.acquire():
        probe.release()
        return False
    return True


def write_state(settings: Settings, state: ClusterState) -> None:
    tmp = settings.state_file.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(settings.state_file)


def read_state(settings: Settings) -> ClusterState | None:
    try:
        return ClusterState(**json.loads(settings.state_file.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def running_state(settings: Settings) -> ClusterState | None:
    """The state of the cluster running under this home, or None (a stale state file is removed)."""
    state = read_state(settings)
    if is_locked(settings) and state is not None and _running(state.pid):
        return state
    if state is not None and not is_locked(settings):
        settings.state_file.unlink(missing_ok=True)
    return None


def _running(pid: int) -> bool:
    """A running process: a supervisor killed a moment ago may linger as a zombie until it is reaped (and the lock
    can outlive it in processes that inherited its descriptor), which is not a running cluster."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # The same option uvicorn sets, so a port left in TIME_WAIT is not reported as busy.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``address`` ("host:port", the host maybe in brackets) within
    ``timeout_s``: a GCS that is gone refuses at once, where a Ray driver would retry it for minutes."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def healthz(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the service's API at ``api_url`` answers its health check (plain HTTP: no Ray, no Serve app)."""
    try:
        with urllib.request.urlopen(f"{api_url}/api/v1/healthz", timeout=timeout_s) as response:
            return response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    except (urllib.error.URLError, OSError, ValueError):
        return False


def check_ports_free(settings: Settings) -> None:
    """Refuse early, naming the flag to change, when a port lilo is about to open is taken."""
    wanted = [(settings.http_host, settings.http_port, "--port")]
    if settings.ray_address is None:  # on an existing cluster the dashboard is Ray's own, already running
        wanted.append(("127.0.0.1", settings.dashboard_port, "--dashboard-port"))
    for host, port, flag in wanted:
        if port_in_use(host, port):
            raise ClusterError(f"Port {port} on {host} is already in use; pass {flag} with a free port.")


def start_private_head(settings: Settings) -> str:
    """Start a new loopback-only Ray head owned by this process and connect to it; returns its GCS address."""
    if "ray" in sys.modules and any(os.environ.get(key) != value for key, value in LOCAL_RAY_ENV.items()):
        raise RuntimeError("Ray was imported before the local environment was set; call prepare_environment().")
    import ray

    os.environ.update(settings.model_paths_env())  # this process deploys, and may ask the registry, too
    settings.ray_temp_dir.mkdir(parents=True, exist_ok=True)
    context = ray.init(
        namespace=NAMESPACE,
        num_cpus=settings.num_cpus,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=settings.dashboard_port,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(settings.ray_temp_dir),
        configure_logging=False,
        log_to_driver=False,
        # No prestarted workers: idle ones cost ~100 MB each and serve nothing until trainers exist. Worker niceness
        # 0: Ray runs its workers at niceness 15 by default, below every ordinary process, but lilo's control plane
        # (the HTTP proxy, the ingress, the futures DB) lives in workers and is latency-bound; the trainers lower
        # their own compute threads instead (Settings.compute_nice).
        _system_config={"prestart_worker_first_driver": False, "worker_niceness": 0},
        # Every worker of this job (Serve's included) keeps its gRPC server on loopback and tunes its GC for latency.
        runtime_env={"worker_process_setup_hook": "cluster.worker_setup.private_head_worker",
                     "env_vars": serve_env(settings)},
    )
    return context.address_info["gcs_address"]


def connect_existing(settings: Settings) -> str:
    """Connect to the Ray cluster at ``settings.ray_address`` (for example "auto" on a `ray up` head)."""
    import ray

    os.environ.update(settings.model_paths_env())
    context = ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False,
                       runtime_env={"worker_process_setup_hook": "cluster.worker_setup.cluster_worker",
                                    "env_vars": serve_env(settings)})
    return context.address_info["gcs_address"]


def serve_env(settings: Settings) -> dict[str, str]:
    """Ray Serve's direct ingress, for every process of the cluster: the API replica serves HTTP on lilo's port
    itself, so a request crosses no proxy process on its way in (one hop and one process's CPU less per request).
    Serve still starts its proxy on the head, as a fallback router, on a port of its own that nobody is sent to,
    given a minute to come up.
    And OpenTelemetry's variables as ``lilo up`` has them, so every part exports traces where they say
    (``lilo.timing.traces``). And where the base models served from a directory under a name of their own lie."""
    return {**{name: value for name, value in os.environ.items() if name.startswith("OTEL_")},
            **settings.model_paths_env(),
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(settings.http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(settings.http_port + 1),
            # A restarted replica takes the port back at once; the quarantine and the draining period are there
            # for load balancers in front of the replicas, and lilo has none.
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
            # Serve's controller kills a proxy not ready within 5 s, and `serve.start` then fails: on 2 busy cores,
            # with a dozen trainers starting beside it, the proxy's worker took longer than that to start (CI).
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
            # The ingress's routes only await actors: run them on the replica's own event loop, not on a second
            # loop in a thread of its own that every request is handed to and back from (bench_service: the
            # ingress's CPU per operation 7.5 -> 5.6 ms on 2 cores).
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def prepare_environment() -> None:
    """Set Ray's local-cluster environment in this process and every process it starts; run it before Ray's import."""
    os.environ.update(LOCAL_RAY_ENV)
    os.environ.setdefault(*GCS_PORT_WAIT_ENV)


def connect_driver(settings: Settings) -> str:
    """Connect this process to the local cluster running under ``settings.home``; returns its GCS address."""
    import ray

    state = running_state(settings)
    if state is None or state.gcs_address is None:
        raise ClusterError(f"No lilo cluster is ready under {settings.home}; start one with `lilo up`.")
    ray.init(address=state.gcs_address, namespace=NAMESPACE, log_to_driver=False)
    return state.gcs_address


def cluster_processes(settings: Settings, supervisor_pid: int | None) -> list[psutil.Process]:
    """Every live process of this home's cluster: the supervisor, its descendants, and strays.

    A stray is a Ray process that outlived a supervisor killed hard (Ray's agents get re-parented to init); it is
    recognised as one of Ray's own processes holding files open under this cluster's own Ray temp dir. Drivers
    that merely connected to the cluster hold such files too, and are never counted.
    """
    processes: dict[int, psutil.Process] = {}
    if supervisor_pid is not None:
        try:
            supervisor = psutil.Process(supervisor_pid)
            processes.update((p.pid, p) for p in (supervisor, *supervisor.children(recursive=True)))
        except psutil.NoSuchProcess:
            pass
    processes.update((p.pid, p) for p in _holding_files_under(settings.ray_temp_dir))
    return _alive(list(processes.values()))


@functools.cache
def _ray_package_dir() -> str:
    spec = importlib.util.find_spec("ray")
    return next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else "/ray/"


def _is_ray_process(process: psutil.Process) -> bool:
    """Ray's daemons, agents and workers: renamed ``ray::...``, Ray's binaries, or scripts inside Ray's package."""
    name = process.name()
    if name.startswith("ray::") or name in ("raylet", "gcs_server"):
        return True
    command = " ".join(process.cmdline()[:4])
    return command.startswith(("ray::", "ray-dashboard-")) or _ray_package_dir() in command


def _holding_files_under(directory: Path) -> list[psutil.Process]:
    prefix = f"{directory}{os.sep}"
    holders = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if _is_ray_process(process) and any(f.path.startswith(prefix) for f in process.open_files()):
                holders.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return holders


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


def stop_cluster(settings: Settings, supervisor_pid: int | None, timeout_s: float = 60.0) -> list[int]:
    """Ask the supervisor to shut down cleanly, then kill whatever of its cluster is left after the timeout.

    With no supervisor (it crashed), only the strays are killed. Returns the pids that had to be killed.
    """
    processes = cluster_processes(settings, supervisor_pid)
    if supervisor_pid is not None:
        try:
            os.kill(supervisor_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while (alive := _alive(processes)) and time.monotonic() < deadline:
            if not any(p.pid == supervisor_pid for p in alive):
                # The supervisor is gone: what it did not stop by now are orphans nobody else will stop.
                deadline = min(deadline, time.monotonic() + ORPHAN_GRACE_S)
            time.sleep(0.1)
    leftovers = _alive(processes) + cluster_processes(settings, None)
    killed = []
    for process in leftovers:
        try:
            process.kill()
            killed.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)
    settings.state_file.unlink(missing_ok=True)
    return sorted(set(killed))
