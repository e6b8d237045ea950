"""How long a model lives, each on a cluster of its own: across `lilo down` and `lilo up` on the same home (it resumes
exactly where it stopped, for the same client), across a restart with other trainers, and after its client vanished
without closing."""

import json
import shutil
import sqlite3
import subprocess
import sys
import time

import httpx

import pytest
import tinker
from tinker import types

from cluster.service import SHUTDOWN_CHECKPOINT
from cluster.ports import free_ports
from helpers import lilo, lilo_down, retrieve_finished, short_home
from lilo.backend.models import build_tiny_llama
from test_tinker_sdk import memorize_datum

ADAM = types.AdamParams(learning_rate=5e-3)


@pytest.fixture
def home():
    home = short_home()
    yield home
    lilo_down(home)
    shutil.rmtree(home, ignore_errors=True)


def up(home, http_port: int, base_models: tuple[str, ...] = ("lilo/tiny-llama",), *extra: str) -> None:
    """A detached cluster with one trainer per base model (trainer i serves base model i)."""
    args = ["up", "--detach", "--home", str(home), "--port", str(http_port), "--dashboard-port", str(free_ports(1)[0]),
            "--num-cpus", str(len(base_models)), "--timeout", "240", *extra]
    for base_model in base_models:
        args += ["--base-model", base_model]
    started = lilo(*args, timeout_s=300)
    assert started.returncode == 0, started.stdout + started.stderr


def step(training, data) -> None:
    training.forward_backward(data, "cross_entropy").result(timeout=120)
    training.optim_step(ADAM).result(timeout=120)


def forward_loss(training, data) -> float:
    return training.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]


def test_a_restarted_service_resumes_every_model_where_it_stopped(home):
    (http_port,) = free_ports(1)
    up(home, http_port)
    data = [memorize_datum()]
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{http_port}", api_key="tml-local") as service:
        # Twins: the same seed, the same steps. The user checkpoints once, then steps again (a step only the
        # shutdown save keeps); `twin` takes one more step than `resumed` before the stop.
        resumed, twin = [service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8, seed=7)
                         .result(timeout=120) for _ in range(2)]
        for training in (resumed, twin):
            step(training, data)
            training.save_state("mine").result(timeout=120)
            step(training, data)
        stopped_at = forward_loss(resumed, data)
        step(twin, data)
        twin_one_step_on = forward_loss(twin, data)
        assert twin_one_step_on < stopped_at

        stopped = lilo("down", "--home", str(home))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "Saved 2 model(s)" in stopped.stdout, stopped.stdout
        saved = home / "checkpoints" / resumed.model_id / "weights" / SHUTDOWN_CHECKPOINT
        meta = json.loads((saved / "meta.json").read_text())
        assert meta["step"] == 2  # the optimizer's state went along, not just the adapter

        up(home, http_port)
        # The same client objects go on: each model is back with its adapter and its optimizer state as they
        # were at the stop, not as at the user's checkpoint.
        assert forward_loss(resumed, data) == pytest.approx(stopped_at, rel=1e-5)
        step(resumed, data)
        assert forward_loss(resumed, data) == pytest.approx(twin_one_step_on, rel=1e-5)


def test_a_restart_with_fewer_trainers_moves_their_models_and_unloads_those_no_trainer_serves(home):
    other_base = str(build_tiny_llama(home / "other-base", seed=2))
    (http_port,) = free_ports(1)
    up(home, http_port, (other_base, "lilo/tiny-llama"))
    data = [memorize_datum()]
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{http_port}", api_key="tml-local") as service:
        moved = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
        orphaned = service.create_lora_training_client(base_model=other_base, rank=8).result(timeout=120)
        for training in (moved, orphaned):
            step(training, data)
        stopped_at = forward_loss(moved, data)
        assert lilo("down", "--home", str(home)).returncode == 0

        # Now one trainer, lilo-trainer-0, serving only tiny-llama: `moved` was on lilo-trainer-1, which is gone,
        # and no trainer serves `orphaned`'s base model.
        up(home, http_port)
        assert forward_loss(moved, data) == pytest.approx(stopped_at, rel=1e-5)
        step(moved, data)
        with pytest.raises(tinker.APIStatusError, match="is not served here any more") as refused:
            orphaned.forward_backward(data, "cross_entropy").result(timeout=120)
        assert refused.value.status_code == 410
        assert f"--base-model {other_base}" in str(refused.value)


def restored_models(home) -> list[str]:
    """Every model the cluster's recovery actor restored, asked from a child process (this one may be a driver of
    another cluster)."""
    script = ("import json, sys\nfrom pathlib import Path\nimport ray\n"
              "from cluster.local import connect_driver, prepare_environment\nfrom lilo.settings import load_settings\n"
              "prepare_environment()\nconnect_driver(load_settings(env={}, home=Path(sys.argv[1])))\n"
              "history = ray.get(ray.get_actor('lilo-recovery', namespace='lilo').history.remote())\n"
              "print(json.dumps(sorted({model for recovery in history for model in recovery['models']})))\n")
    done = subprocess.run([sys.executable, "-c", script, str(home)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def raw_model(http: httpx.Client) -> str:
    """A model made over plain HTTP by a client that then vanishes: its session never beats."""
    session_id = http.post("/create_session", json={}).json()["session_id"]
    created = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                               "base_model": "lilo/tiny-llama", "lora_config": {"rank": 4}})
    assert created.status_code == 200, created.text
    retrieve_finished(http, "/retrieve_future", created.json()["request_id"])
    return created.json()["model_id"]


def test_the_models_of_a_session_that_stops_beating_are_unloaded_and_a_live_clients_stay(home):
    timeout_s = 20  # twice the SDK's heartbeat period
    (http_port,) = free_ports(1)
    up(home, http_port, ("lilo/tiny-llama",), "--session-timeout", str(timeout_s))
    data = [memorize_datum()]
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{http_port}", api_key="tml-local") as service, \
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}/api/v1", headers={"X-API-Key": "tml-local"},
                         timeout=60) as http:
        alive = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
        vanished = raw_model(http)
        started = time.monotonic()
        while http.post("/get_info", json={"model_id": vanished}).status_code == 200:
            assert time.monotonic() - started < 6 * timeout_s, "the idle session's model was never unloaded"
            step(alive, data)
        info = http.post("/get_info", json={"model_id": vanished})
        assert info.status_code == 410
        assert f"its session sent no heartbeat for {timeout_s} s" in info.json()["detail"]
        # The SDK client beat all along: its model trains on.
        for _ in range(2):
            step(alive, data)

        # A model whose client vanished before a restart, and stayed away past the timeout, is not restored into
        # a slot nobody would use: the next start unloads it first.
        left = raw_model(http)
        left_at = time.monotonic()
        assert lilo("down", "--home", str(home)).returncode == 0
        time.sleep(max(0.0, timeout_s + 2 - (time.monotonic() - left_at)))
        up(home, http_port, ("lilo/tiny-llama",), "--session-timeout", str(timeout_s))
        started = time.monotonic()
        while http.post("/get_info", json={"model_id": left}).status_code != 410:
            assert time.monotonic() - started < 60, "the abandoned model was not unloaded at the start"
            time.sleep(0.5)
        assert left not in restored_models(home)
        with sqlite3.connect(home / "futures.db") as db:
            (status,) = db.execute("SELECT status FROM futures WHERE model_id = ? AND kind = 'unload_model'",
                                   (left,)).fetchone()
        assert status == "completed"  # no trainer held it, so there was nothing to free
