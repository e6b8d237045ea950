"""Provenance spans resolved against recorded sequences (pure), and the records themselves in a real SQLite file:
who may use them, for how long, and that they outlive the process that wrote them."""

import numpy as np
import pytest

from lilo.backend.provenance import (
    PROMPT, RECORDED_LOGPROBS, RECORDED_MASK, SAMPLED, Provenance, RecordedSequence, Span, named_sequences,
    recorded_inputs,
)
from lilo.errors import GoneError, InvalidRequestError, NotFoundError
from lilo.futures.sequences import EXPIRED_KEPT_S, RECORD_TTL_S, RecordedSample
from lilo.futures.store import Completion, FuturesStore, Submission
from lilo.engine.commands import Kind

PROMPT_TOKENS = [11, 12, 13]
SAMPLED_TOKENS = [21, 22, 23, 24]
SAMPLED_LOGPROBS = [-0.5, -1.5, -2.5, -3.5]
RECORDS = {"5:0": RecordedSequence("5:0", np.array(PROMPT_TOKENS, dtype=np.int32),
                                   np.array(SAMPLED_TOKENS, dtype=np.int32),
                                   np.array(SAMPLED_LOGPROBS, dtype=np.float32))}


def rl_datum_provenance(sequence_id: str = "5:0") -> tuple[np.ndarray, np.ndarray, Provenance]:
    """The cookbook's datum of one sampled sequence: input = prompt + sampled[:-1], targets = input shifted by one."""
    full = PROMPT_TOKENS + SAMPLED_TOKENS
    provenance = Provenance(
        (Span(PROMPT, sequence_id, 0, 3), Span(SAMPLED, sequence_id, 0, 3)),
        (Span(PROMPT, sequence_id, 1, 2), Span(SAMPLED, sequence_id, 0, 4)))
    return np.array(full[:-1]), np.array(full[1:]), provenance


def test_sampled_targets_get_the_recorded_logprobs_and_prompt_targets_none():
    tokens, targets, provenance = rl_datum_provenance()
    inputs = recorded_inputs(0, tokens, targets, provenance, RECORDS)
    np.testing.assert_array_equal(inputs[RECORDED_MASK], [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(inputs[RECORDED_LOGPROBS], [0, 0, *SAMPLED_LOGPROBS])
    assert named_sequences([provenance, None]) == ["5:0"]


def test_a_run_that_starts_mid_sequence_takes_the_logprobs_from_its_offset():
    provenance = Provenance((Span(SAMPLED, "5:0", 1, 2),), (Span(SAMPLED, "5:0", 2, 2),))
    inputs = recorded_inputs(0, np.array([22, 23]), np.array([23, 24]), provenance, RECORDS)
    np.testing.assert_array_equal(inputs[RECORDED_LOGPROBS], SAMPLED_LOGPROBS[2:])


@pytest.mark.parametrize("mutate, message", [
    (lambda t, g, p: (t[:-1], g[:-1], p), "model_input provenance spans cover 6 positions but the input tokens has 5"),
    (lambda t, g, p: (t, g, Provenance(p.model_input, p.loss_fn_inputs[1:])),
     "loss_fn_inputs provenance spans cover 4 positions but target_tokens has 6"),
    (lambda t, g, p: (t, np.where(g == 23, 99, g), p),
     "loss_fn_inputs span 1 .*sampled tokens of sequence '5:0'.* differ from the ones recorded"),
    (lambda t, g, p: (t, g, Provenance(p.model_input, (Span(PROMPT, "5:0", 2, 2), p.loss_fn_inputs[1]))),
     "loss_fn_inputs span 0 .*offset 2, length 2\\) reaches past the 3 prompt tokens"),
])
def test_claims_that_do_not_fit_the_record_are_refused_naming_datum_and_span(mutate, message):
    tokens, targets, provenance = mutate(*rl_datum_provenance())
    with pytest.raises(InvalidRequestError, match=f"Datum 3: .*{message}"):
        recorded_inputs(3, tokens, targets, provenance, RECORDS)


# --- the records, in the futures DB file ----------------------------------------------------------------------
@pytest.fixture
def store(tmp_path, clock):
    opened = FuturesStore(tmp_path / "futures.db", clock=clock)
    yield opened
    opened.close()


def record_a_sample(store: FuturesStore, session: str = "s1", tenant: str = "alpha") -> int:
    """A sampling session of ``session``, one sample with record_stability_info completed; its request id."""
    store.add_session(session, tenant=tenant)
    store.add_model(f"{session}:train:0", "tiny", {"rank": 4}, tenant=tenant, session_id=session)
    store.add_sampling_session(f"{session}:sample:0", session, "tiny", tenant=tenant)
    request_id = store.submit(Submission(f"{session}:sample:0", Kind.SAMPLE, {"prompt": PROMPT_TOKENS}, seq_id=0,
                                         tenant=tenant, trainer="t0"))
    recorded = RecordedSample(PROMPT_TOKENS, [(SAMPLED_TOKENS, SAMPLED_LOGPROBS), ([31], [-0.25])])
    assert store.complete_many([Completion.success(request_id, b"result", Kind.SAMPLE, recorded=recorded)])
    return request_id


def test_a_recorded_sample_gives_each_sequence_to_its_session_under_the_id_the_client_got(store):
    rid = record_a_sample(store)
    records = store.recorded_sequences("s1:train:0", [f"{rid}:0", f"{rid}:1"], "alpha")
    assert records[f"{rid}:0"].tokens.tolist() == SAMPLED_TOKENS
    assert records[f"{rid}:0"].prompt.tolist() == PROMPT_TOKENS
    np.testing.assert_array_equal(records[f"{rid}:1"].logprobs, [-0.25])


def test_records_outlive_the_store_that_wrote_them(tmp_path, clock):
    first = FuturesStore(tmp_path / "futures.db", clock=clock)
    rid = record_a_sample(first)
    first.close()
    reopened = FuturesStore(tmp_path / "futures.db", clock=clock)
    try:
        assert reopened.recorded_sequences("s1:train:0", [f"{rid}:0"], "alpha")[f"{rid}:0"].tokens.tolist() \
            == SAMPLED_TOKENS
    finally:
        reopened.close()


def test_unknown_and_another_tenants_sequences_are_the_same_404(store):
    rid = record_a_sample(store, tenant="alpha")
    record_a_sample(store, session="s2", tenant="beta")
    with pytest.raises(NotFoundError, match="Unknown sequence_id '999:0'"):
        store.recorded_sequences("s1:train:0", ["999:0"], "alpha")
    with pytest.raises(NotFoundError, match=f"Unknown sequence_id '{rid}:0'"):
        store.recorded_sequences("s2:train:0", [f"{rid}:0"], "beta")
    with pytest.raises(NotFoundError, match="Unknown model_id 's2:train:0'"):  # beta's model, asked as alpha
        store.recorded_sequences("s2:train:0", [f"{rid}:0"], "alpha")


def test_a_sequence_of_another_session_is_refused_saying_to_sample_and_train_in_one(store):
    rid = record_a_sample(store, session="s1")
    record_a_sample(store, session="s2")
    with pytest.raises(InvalidRequestError, match=f"'{rid}:0' was sampled in session 's1'.*same session"):
        store.recorded_sequences("s2:train:0", [f"{rid}:0"], "alpha")


def test_a_sequence_expires_a_day_after_its_last_use_then_is_pruned(store, clock):
    rid = record_a_sample(store)
    clock.now += RECORD_TTL_S - 1
    store.recorded_sequences("s1:train:0", [f"{rid}:0"], "alpha")  # used: its day starts again
    clock.now += RECORD_TTL_S - 1
    store.recorded_sequences("s1:train:0", [f"{rid}:0"], "alpha")
    with pytest.raises(GoneError, match=f"'{rid}:1' expired"):  # never used since it was sampled
        store.recorded_sequences("s1:train:0", [f"{rid}:1"], "alpha")
    clock.now += RECORD_TTL_S + EXPIRED_KEPT_S + 1
    store.prune()
    with pytest.raises(NotFoundError, match=f"Unknown sequence_id '{rid}:0'"):
        store.recorded_sequences("s1:train:0", [f"{rid}:0"], "alpha")
