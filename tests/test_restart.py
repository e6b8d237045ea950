"""`lilo down`, then `lilo up` on the same home: every model resumes exactly where it stopped, for the same client."""

import json
import shutil

import pytest
import tinker
from tinker import types

from helpers import free_port, lilo, short_home
from serve.cli import SHUTDOWN_CHECKPOINT
from test_tinker_sdk import memorize_datum

ADAM = types.AdamParams(learning_rate=5e-3)


@pytest.fixture
def home():
    home = short_home()
    yield home
    stopped = lilo("down", "--home", str(home))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    shutil.rmtree(home, ignore_errors=True)


def up(home, http_port: int) -> None:
    started = lilo("up", "--detach", "--home", str(home), "--port", str(http_port), "--dashboard-port",
                   str(free_port()), "--num-cpus", "1", "--base-model", "lilo/tiny-llama", "--timeout", "240",
                   timeout_s=300)
    assert started.returncode == 0, started.stdout + started.stderr


def step(training, data) -> None:
    training.forward_backward(data, "cross_entropy").result(timeout=120)
    training.optim_step(ADAM).result(timeout=120)


def forward_loss(training, data) -> float:
    return training.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]


def test_a_restarted_service_resumes_every_model_where_it_stopped(home):
    http_port = free_port()
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
        meta = json.loads((home / "checkpoints" / resumed.model_id / "weights" / SHUTDOWN_CHECKPOINT / "meta.json").read_text())
        assert meta["step"] == 2  # the optimizer's state went along, not just the adapter

        up(home, http_port)
        # The same client objects go on: each model is back with its adapter and its optimizer state as they
        # were at the stop, not as at the user's checkpoint.
        assert forward_loss(resumed, data) == pytest.approx(stopped_at, rel=1e-5)
        step(resumed, data)
        assert forward_loss(resumed, data) == pytest.approx(twin_one_step_on, rel=1e-5)
