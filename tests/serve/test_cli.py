"""Errors a user can act on, from the real `lilo` command (run as from a user's shell: helpers.lilo)."""

import contextlib
import json
import os
import re
import shutil
import socket
import time

import pytest

from cluster.local import ClusterState, SupervisorLock, write_state
from cluster.ports import free_ports
from conftest import SHARDED_BASE_MODEL
from helpers import imported_top_levels, lilo, short_home
from lilo.settings import load_settings


@pytest.fixture
def empty_home():
    home = short_home()
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_up_while_running_prints_its_url_and_fails(local_cluster):
    result = lilo("up", "--home", str(local_cluster.home), "--port", str(free_ports(1)[0]))
    assert result.returncode == 1
    assert f"already running at {local_cluster.api_url}" in result.stdout
    assert "lilo down" in result.stdout


@pytest.mark.parametrize("mode", [["--detach"], []], ids=["detached", "foreground"])
@pytest.mark.parametrize("flag", ["--port", "--dashboard-port"])
def test_port_in_use_names_the_port_and_the_flag(empty_home, flag, mode):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other_flag = "--dashboard-port" if flag == "--port" else "--port"
        result = lilo("up", *mode, "--home", str(empty_home), flag, str(port), other_flag, str(free_ports(1)[0]))
    assert result.returncode == 1
    assert f"Port {port}" in result.stdout
    assert f"pass {flag} with a free port" in result.stdout
    assert not (empty_home / "cluster.json").exists()


def test_down_with_nothing_running_says_so_and_succeeds(empty_home):
    result = lilo("down", "--home", str(empty_home))
    assert result.returncode == 0
    assert "nothing to stop" in result.stdout


def test_status_reports_a_running_cluster(local_cluster):
    result = lilo("status", "--home", str(local_cluster.home), timeout_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert local_cluster.api_url in result.stdout
    assert "healthz: ok" in result.stdout
    assert "  Trainers:    " in result.stdout and "lilo-trainer-0: lilo/tiny-llama" in result.stdout
    # The session cluster's sharded base model: each of its trainers says it spans two rank processes, and once
    # ready, where each rank runs and the share of the base it holds.
    assert f"{SHARDED_BASE_MODEL} on CPU over 2 ranks (processes)" in result.stdout, result.stdout
    rank_line = r"\n        rank {}: node 127\.0\.0\.1, pid \d+, CPU, [\d.]+ MB of base weights\n"
    for _ in range(30):  # the sharded trainer may still be loading its ranks
        if re.search(rank_line.format(1), result.stdout):
            break
        time.sleep(2)
        result = lilo("status", "--home", str(local_cluster.home), timeout_s=60)
    assert re.search(rank_line.format(0), result.stdout) and re.search(rank_line.format(1), result.stdout), \
        result.stdout


def test_the_lilo_command_imports_no_ray_before_it_prepares_rays_environment():
    """Its ``main`` prepares the environment first of all, before any command runs: Ray reads it when imported, and
    without it looks for the loopback-only cluster at this machine's first other address, for minutes."""
    assert "ray" not in imported_top_levels(["serve.cli"])


@contextlib.contextmanager
def silent_supervisor(home, status: str):
    """A supervisor that runs (this process holds the home's lock) whose recorded state, ``status``, names a GCS
    port and an API port that nobody listens on; yields the GCS port."""
    settings = load_settings(env={}, home=home)
    lock = SupervisorLock(settings)
    assert lock.acquire()
    gcs_port, http_port = free_ports(2)
    write_state(settings, ClusterState(pid=os.getpid(), status=status, home=str(home),
                                       api_url=f"http://127.0.0.1:{http_port}", dashboard_url=settings.dashboard_url,
                                       gcs_address=f"127.0.0.1:{gcs_port}", started_at=time.time()))
    try:
        yield gcs_port
    finally:
        lock.release()


def test_status_of_a_cluster_that_does_not_answer_exits_3_within_seconds(empty_home):
    """A supervisor that runs while its Ray head is gone."""
    with silent_supervisor(empty_home, "ready") as gcs_port:
        result = lilo("status", "--home", str(empty_home), timeout_s=10)
        as_json = lilo("status", "--json", "--home", str(empty_home), timeout_s=10)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"its Ray cluster (GCS 127.0.0.1:{gcs_port}) does not answer" in result.stdout
    assert "lilo down" in result.stdout
    assert as_json.returncode == 3
    report = json.loads(as_json.stdout)
    assert (report["running"], report["answering"], report["healthy"]) == (True, False, False)


def test_status_of_a_cluster_still_starting_says_so_and_exits_4(empty_home):
    """``lilo up`` has recorded the cluster as starting, and its Ray head does not answer yet."""
    with silent_supervisor(empty_home, "starting"):
        result = lilo("status", "--home", str(empty_home), timeout_s=10)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "lilo is starting" in result.stdout
    assert str(load_settings(env={}, home=empty_home).log_file) in result.stdout
    assert "lilo down" not in result.stdout


def test_status_without_a_cluster_exits_3(empty_home):
    result = lilo("status", "--home", str(empty_home))
    assert result.returncode == 3
    assert "not running" in result.stdout


def test_bad_settings_are_usage_errors_with_a_message(empty_home):
    result = lilo("up", "--home", str(empty_home), "--base-model", "no-such-model")
    assert result.returncode == 2
    assert "Unknown base model(s) no-such-model" in result.stderr
    assert "a local directory with a transformers config.json" in result.stderr
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in result.stderr


def test_status_says_which_samplers_a_trainer_relays_to_and_which_engine_answered_its_samples():
    from serve.cli.status import sampler_note

    assert sampler_note(None) == ""
    assert sampler_note({"samplers": [], "ready": [], "counts": {}, "loaded": {}}) == ""
    note = sampler_note({"samplers": ["lilo-sampler-0", "lilo-sampler-1"], "ready": ["lilo-sampler-0"],
                         "counts": {"vllm": 12, "torch: prompt_alt_tokens_k": 2, "torch: the sampler died": 1},
                         "loaded": {}})
    assert note == (", samplers lilo-sampler-0 (ready), lilo-sampler-1 (not ready): 12 samples on vLLM, 3 on torch")
