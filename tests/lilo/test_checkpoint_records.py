"""Checkpoint expiry and publication: the pure rules (who may use a checkpoint, which expired ones the sweep
deletes, TTL bounds) and their records in a real SQLite futures database."""

import pytest

from lilo.errors import GoneError, InvalidRequestError, NotFoundError
from lilo.futures.checkpoint_records import (
    MAX_TTL_S, MIN_TTL_S, CheckpointRecord, access_refusal, due_for_deletion, expiry_for,
)
from lilo.futures.store import FuturesStore

PATH = "tinker://run-a/weights/step-1"
NOW = 1000.0


def record(**fields) -> CheckpointRecord:
    return CheckpointRecord(**{"tinker_path": PATH, "model_id": "run-a", "tenant": "alpha", **fields})


@pytest.mark.parametrize(("caller", "rec", "write", "refusal"), [
    ("alpha", None, False, None),                                   # the owner reads
    ("alpha", None, True, None),                                    # and changes
    ("beta", None, False, "unknown"),                               # another tenant: as if there were none
    ("beta", record(public=True), False, None),                     # a public one reads by its path
    ("beta", record(public=True), True, "unknown"),                 # but never changes or deletes it
    ("alpha", record(expires_at=NOW), False, "expired"),            # expired at this very second
    ("alpha", record(expires_at=NOW + 1), False, None),
    ("beta", record(public=True, expires_at=NOW - 5), False, "expired"),
    ("beta", record(expires_at=NOW - 5), False, "unknown"),         # nothing of a private one is revealed
    (None, None, True, None),                                       # lilo itself
])
def test_who_may_use_a_checkpoint(caller, rec, write, refusal):
    assert access_refusal(caller, "alpha", rec, NOW, write) == refusal


def test_the_sweep_takes_expired_checkpoints_not_deleted_yet():
    records = [record(tinker_path="a", expires_at=NOW - 1), record(tinker_path="b", expires_at=NOW + 1),
               record(tinker_path="c"), record(tinker_path="d", expires_at=NOW - 9, deleted_at=NOW - 2),
               record(tinker_path="e", expires_at=NOW)]
    assert [r.tinker_path for r in due_for_deletion(records, NOW)] == ["a", "e"]


def test_a_ttl_is_an_hour_to_ten_years_or_none():
    assert expiry_for(None, NOW) is None
    assert expiry_for(MIN_TTL_S, NOW) == NOW + MIN_TTL_S and expiry_for(MAX_TTL_S, NOW) == NOW + MAX_TTL_S
    for bad in (MIN_TTL_S - 1, MAX_TTL_S + 1, 0, -5, True, 3600.5, "3600"):
        with pytest.raises(InvalidRequestError, match="between|from 3600"):
            expiry_for(bad, NOW)


@pytest.fixture
def store(ledger, clock):
    opened = FuturesStore(ledger, clock=clock)
    opened.add_model("run-a", "lilo/tiny-llama", {"rank": 4}, tenant="alpha", trainer="lilo-trainer-0")
    yield opened
    opened.close()


def test_records_say_when_a_checkpoint_expires_and_who_may_read_it(store, clock):
    records = store.checkpoints
    records.record_save(PATH, "alpha", clock.now + 50)
    run, rec = records.readable(PATH, "alpha")
    assert run["base_model"] == "lilo/tiny-llama" and rec.expires_at == clock.now + 50 and not rec.public
    with pytest.raises(NotFoundError, match="Unknown model_id 'run-a'"):
        records.readable(PATH, "beta")
    records.set_public(PATH, "alpha", True)
    assert records.readable(PATH, "beta")[1].public
    with pytest.raises(NotFoundError):
        records.readable(PATH, "beta", write=True)
    assert records.due() == []
    clock.now += 50
    with pytest.raises(GoneError, match="expired at .* \\(its TTL\\)"):
        records.readable(PATH, "alpha")
    assert [(r.tinker_path, trainer) for r, trainer in records.due()] == [(PATH, "lilo-trainer-0")]
    records.mark_deleted([PATH])
    assert records.due() == []
    with pytest.raises(GoneError):  # still says it expired, after its files are gone
        records.readable(PATH, "alpha")
    records.record_save(PATH, "alpha", None)  # saved again under the same name: it lives, still public
    assert records.readable(PATH, "beta")[1] == CheckpointRecord(PATH, "run-a", "alpha", None, True, None)
    assert list(records.of_runs(["run-a", "run-b"])) == [PATH]
    records.forget(PATH)
    assert records.of_runs(["run-a"]) == {} and records.readable(PATH, "alpha")[1] is None
