"""`lilo up` then stop: nothing of that cluster remains, however it was stopped."""

import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from cluster.local import cluster_processes, read_state
from cluster.ports import free_ports
from helpers import LILO, eventually, lilo, lilo_down, plain_shell_env, short_home
from lilo.settings import load_settings


@pytest.fixture
def settings():
    home = short_home()
    http_port, dashboard_port = free_ports(2)
    yield load_settings(env={}, home=home, http_port=http_port, dashboard_port=dashboard_port, num_cpus=1)
    # Keeps the home of a cluster that could not be stopped (lilo_down raises first): its files are how a later
    # `lilo down` finds it.
    lilo_down(home)
    shutil.rmtree(home, ignore_errors=True)


def up_args(settings) -> list[str]:
    return ["up", "--home", str(settings.home), "--port", str(settings.http_port),
            "--dashboard-port", str(settings.dashboard_port), "--num-cpus", "1", "--base-model", "lilo/tiny-llama",
            "--timeout", "240"]


def wait_until_ready(settings, supervisor, log_path, timeout_s: float = 240):
    def ready():
        state = read_state(settings)
        if state is not None and state.status == "ready":
            return state
        assert supervisor.poll() is None, f"lilo up exited with {supervisor.returncode}:\n{log_path.read_text()}"
        return None

    return eventually(ready, lambda: f"lilo ready:\n{log_path.read_text()}", timeout_s=timeout_s, every_s=0.2)


def processes_of_running_cluster(settings) -> list[psutil.Process]:
    state = read_state(settings)
    processes = cluster_processes(settings, state.pid)
    names = " ".join(p.name() for p in processes)
    # The tree really is the cluster: Ray's own daemons and Serve's actors are in it.
    assert "raylet" in names and "gcs_server" in names and "ray::ProxyActor" in names, names
    return processes


def wait_dead(process: psutil.Process, timeout_s: float = 30) -> None:
    """Until a process just killed is gone, or a zombie (its parent may not reap it soon)."""
    def gone() -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    eventually(gone, f"{process} gone after it was killed", timeout_s=timeout_s, every_s=0.1)


def assert_nothing_remains(settings, processes):
    gone, alive = psutil.wait_procs(processes, timeout=15)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    assert cluster_processes(settings, None) == []
    assert not settings.state_file.exists()


def test_ctrl_c_on_foreground_up_stops_every_process(settings):
    log_path = settings.home / "foreground.log"
    with open(log_path, "w") as log:
        supervisor = subprocess.Popen([LILO, *up_args(settings)], stdout=log, stderr=subprocess.STDOUT,
                                      env=plain_shell_env())
    try:
        wait_until_ready(settings, supervisor, log_path)
        processes = processes_of_running_cluster(settings)
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(timeout=60) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert "Press Ctrl-C to stop" in (settings.home / "foreground.log").read_text()
    assert_nothing_remains(settings, processes)


DRIVER = """
import sys, time
from cluster.local import connect_driver, prepare_environment
from lilo.settings import load_settings
prepare_environment()
connect_driver(load_settings(env={}, home=sys.argv[1]))
print("connected", flush=True)
time.sleep(600)
"""


def test_down_stops_every_process_of_a_detached_cluster_but_not_its_drivers(settings):
    started = lilo(*up_args(settings), "--detach")
    assert started.returncode == 0, started.stdout
    assert f"Tinker API:  {settings.api_url}" in started.stdout
    processes = processes_of_running_cluster(settings)
    # A user's script connected as a Ray driver holds log files under the cluster's temp dir, like Ray's own
    # processes do; stopping the cluster must not kill it.
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(settings.home)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "connected"
        stopped = lilo("down", "--home", str(settings.home))
        assert stopped.returncode == 0
        assert "Stopped in" in stopped.stdout
        assert_nothing_remains(settings, processes)
        assert driver.poll() is None
    finally:
        driver.kill()
    assert lilo("status", "--home", str(settings.home)).returncode == 3


def test_down_cleans_up_after_a_supervisor_killed_hard(settings):
    started = lilo(*up_args(settings), "--detach")
    assert started.returncode == 0, started.stdout
    processes = processes_of_running_cluster(settings)
    supervisor = psutil.Process(read_state(settings).pid)
    supervisor.kill()
    wait_dead(supervisor)
    stopped = lilo("down", "--home", str(settings.home))
    assert stopped.returncode == 0
    assert "nothing to stop" in stopped.stdout
    assert_nothing_remains(settings, processes)


def test_status_of_a_cluster_whose_head_was_killed_exits_3_and_down_cleans_up(settings):
    started = lilo(*up_args(settings), "--detach")
    assert started.returncode == 0, started.stdout
    processes = processes_of_running_cluster(settings)
    running = lilo("status", "--home", str(settings.home), timeout_s=60)
    assert running.returncode == 0, running.stdout + running.stderr
    assert f"Tinker API:  {settings.api_url}   healthz: ok" in running.stdout
    gcs = next(process for process in processes if process.name() == "gcs_server")
    gcs.kill()
    wait_dead(gcs)
    silent = lilo("status", "--home", str(settings.home), timeout_s=10)
    assert silent.returncode == 3, silent.stdout + silent.stderr
    assert "does not answer" in silent.stdout or "not running" in silent.stdout, silent.stdout
    # Its supervisor cannot save the models or remove the app through a dead GCS: do not wait the full minute.
    stopped = lilo("down", "--home", str(settings.home), "--timeout", "10")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert_nothing_remains(settings, processes)
