"""Errors a user can act on, from the real `lilo` command."""

import shutil
import socket

import pytest

from cluster.ports import free_ports
from helpers import lilo, short_home


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
    result = lilo("status", "--home", str(local_cluster.home))
    assert result.returncode == 0
    assert local_cluster.api_url in result.stdout
    assert "healthz: ok" in result.stdout


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
    from serve.cli import sampler_note

    assert sampler_note(None) == ""
    assert sampler_note({"samplers": [], "ready": [], "counts": {}, "loaded": {}}) == ""
    note = sampler_note({"samplers": ["lilo-sampler-0", "lilo-sampler-1"], "ready": ["lilo-sampler-0"],
                         "counts": {"vllm": 12, "torch: prompt_alt_tokens_k": 2, "torch: the sampler died": 1},
                         "loaded": {}})
    assert note == (", samplers lilo-sampler-0 (ready), lilo-sampler-1 (not ready): 12 samples on vLLM, 3 on torch")
