"""A service whose futures ledger is PostgreSQL (``lilo up --ledger postgresql://...``; a real server on loopback,
benchmarks/postgres_server.py): the SDK's training, saving, sampling and listing flow, and the database going away
for a while in the middle of a step, which delays completions but loses none and leaves none pending."""

import time

import numpy as np
import pytest
import tinker
from sqlalchemy import create_engine, text

from benchmarks.postgres_server import NO_FSYNC, postgres_server
from helpers import own_service, sdk_datum

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ledger_service():
    with postgres_server(NO_FSYNC) as server:
        ledger = server.create_database(password="s3cret")
        with own_service("--ledger", ledger, "--trainers", "1", "--base-model", TINY) as (api_url, started):
            yield server, ledger, api_url, started


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
    _, ledger, _, started = ledger_service
    assert "The futures ledger is PostgreSQL: postgresql://postgres:***@127.0.0.1:" in started
    assert "s3cret" not in started
    client = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    losses = [train_step(client, 1) for _ in range(3)]
    assert losses[-1] < losses[0]
    saved = client.save_state("on-postgresql").result(timeout=TIMEOUT_S).path
    sampler = client.save_weights_and_get_sampling_client("on-postgresql-sampler")
    prompt = tinker.ModelInput.from_ints(sdk_datum(3).model_input.to_ints()[:8])
    sampled = sampler.sample(prompt, 2, tinker.SamplingParams(max_tokens=5, temperature=1.0)).result(
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
    server, ledger, _, _ = ledger_service
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
