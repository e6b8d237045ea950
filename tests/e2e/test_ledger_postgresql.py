"""A service whose futures ledger is PostgreSQL (``lilo up --ledger postgresql://...``; a real server on loopback,
benchmarks/postgres_server.py): the SDK's training, saving, sampling and listing flow, and real faults: the database
going away for a while in the middle of a step (completions delayed, none lost, none left pending), the futures DB
actor killed (nothing acknowledged lost), a trainer killed mid-step (its in-flight future fails with a message, its
model comes back from its checkpoint)."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tinker
from sqlalchemy import create_engine, text

from benchmarks.postgres_server import NO_FSYNC, postgres_server
from helpers import own_service, sdk_datum, short_home

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120


# Run in a child process: this test process may already be a driver of the session cluster.
PIDS = """
import json, sys
import ray
ray.init(address=sys.argv[1], namespace="lilo", log_to_driver=False)
from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.trainer.config import trainer_name
futures = ray.get(ray.get_actor(FUTURES_ACTOR_NAME).stats.remote())["pid"]
trainer = ray.get(ray.get_actor(trainer_name(0)).ready.remote())["pid"]
print(json.dumps({"futures": futures, "trainer": trainer}))
"""


@pytest.fixture(scope="module")
def ledger_service():
    home = short_home()
    with postgres_server(NO_FSYNC) as server:
        ledger = server.create_database(password="s3cret")
        with own_service("--ledger", ledger, "--trainers", "1", "--base-model", TINY, home=home) as (api_url, out):
            yield server, ledger, api_url, out, home


def pids(home) -> dict[str, int]:
    """The process ids of the service's futures DB actor and its trainer."""
    address = json.loads((home / "cluster.json").read_text())["gcs_address"]
    found = subprocess.run([sys.executable, "-c", PIDS, address], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    return json.loads(found.stdout.strip().splitlines()[-1])


def kill(pid: int) -> None:
    process = psutil.Process(pid)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture
def service(ledger_service):
    with tinker.ServiceClient(base_url=ledger_service[2], api_key="tml-local-test") as client:
        yield client


def statuses(ledger: str, model_id: str) -> dict[str, int]:
    """``status -> count`` of the model's futures, read from the PostgreSQL ledger itself."""
    engine = create_engine(ledger.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT status, count(*) FROM futures WHERE model_id = :model "
                                           "GROUP BY status"), {"model": model_id}).all()
    finally:
        engine.dispose()
    return dict(rows)


def train_step(client, seed: int) -> float:
    loss = client.forward_backward([sdk_datum(seed, 33)], "cross_entropy").result(timeout=TIMEOUT_S).metrics
    client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
    return loss["loss:sum"]


def test_the_sdk_trains_saves_samples_and_lists_on_a_postgresql_ledger(ledger_service, service):
    _, ledger, _, started, _ = ledger_service
    assert "The futures ledger is PostgreSQL: postgresql://postgres:***@127.0.0.1:" in started
    assert "s3cret" not in started
    client = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    losses = [train_step(client, 1) for _ in range(3)]
    assert losses[-1] < losses[0]
    saved = client.save_state("on-postgresql").result(timeout=TIMEOUT_S).path
    sampler = client.save_weights_and_get_sampling_client("on-postgresql-sampler")
    prompt = tinker.ModelInput.from_ints(sdk_datum(3).model_input.to_ints()[:8])
    # stop=[]: no end-of-sequence stop, so both run to max_tokens (at temperature 1 one sometimes drew it early).
    sampled = sampler.sample(prompt, 2, tinker.SamplingParams(max_tokens=5, temperature=1.0, stop=[])).result(
        timeout=TIMEOUT_S)
    assert len(sampled.sequences) == 2 and all(len(sequence.tokens) == 5 for sequence in sampled.sequences)
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(client.model_id).result(timeout=TIMEOUT_S)
    assert saved in {checkpoint.tinker_path for checkpoint in listed.checkpoints}
    assert client.model_id in {run.training_run_id for run in rest.list_training_runs().result(
        timeout=TIMEOUT_S).training_runs}
    resumed = service.create_training_client_from_state(saved).result(timeout=TIMEOUT_S)
    assert np.isfinite(train_step(resumed, 2))
    counts = statuses(ledger, client.model_id)
    assert counts.get("completed", 0) >= 9 and "pending" not in counts and "failed" not in counts


def test_the_ledger_going_away_mid_step_delays_completions_but_loses_none(ledger_service, service):
    server, ledger, _, _, _ = ledger_service
    client = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    train_step(client, 1)
    step = client.forward_backward([sdk_datum(seed, 129) for seed in range(16)], "cross_entropy")
    server.stop()  # a real outage: the trainer's result write, and the submission below, fail and are retried
    try:
        queued_during_outage = client.optim_step(tinker.AdamParams(learning_rate=1e-2))
        time.sleep(8)
    finally:
        server.start()
    assert np.isfinite(step.result(timeout=TIMEOUT_S).metrics["loss:sum"])
    queued_during_outage.result(timeout=TIMEOUT_S)
    assert np.isfinite(train_step(client, 2))  # and the service goes on
    counts = statuses(ledger, client.model_id)
    assert "pending" not in counts and "failed" not in counts


def test_killing_the_futures_db_actor_loses_no_acknowledged_request(ledger_service, service):
    _, ledger, _, _, home = ledger_service
    client = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    train_step(client, 1)
    before = pids(home)
    acknowledged = [client.forward_backward([sdk_datum(seed, 129) for seed in range(16)], "cross_entropy")
                    for _ in range(2)]
    kill(before["futures"])
    assert all(np.isfinite(future.result(timeout=TIMEOUT_S).metrics["loss:sum"]) for future in acknowledged)
    assert pids(home)["futures"] != before["futures"]  # a new process, on the same database
    assert np.isfinite(train_step(client, 2))
    counts = statuses(ledger, client.model_id)
    assert "pending" not in counts and "failed" not in counts


def test_a_trainer_killed_mid_step_fails_its_future_and_its_model_comes_back_from_its_checkpoint(ledger_service,
                                                                                                  service):
    _, ledger, _, _, home = ledger_service
    client = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    train_step(client, 1)
    client.save_state("before-the-kill").result(timeout=TIMEOUT_S)
    probe = sdk_datum(99, 33)
    saved_loss = client.forward([probe], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"]
    in_flight = client.forward_backward([sdk_datum(seed, 257) for seed in range(64)], "cross_entropy")
    time.sleep(0.3)
    kill(pids(home)["trainer"])
    with pytest.raises(tinker.RequestFailedError) as failed:
        in_flight.result(timeout=TIMEOUT_S)
    assert failed.value.category == "server" and "stopped before this request finished" in failed.value.message
    restored = client.forward([probe], "cross_entropy").result(timeout=180).metrics["loss:sum"]
    assert restored == pytest.approx(saved_loss, rel=1e-5)
    assert "pending" not in statuses(ledger, client.model_id)
