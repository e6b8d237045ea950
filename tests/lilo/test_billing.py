"""``tinker billing usage`` from a real ledger, SQLite and PostgreSQL (lilo.futures.billing): hourly buckets per
session and base model of a tenant's finished requests, what each counts, and the window's rules."""

import datetime

import pytest

from lilo.errors import InvalidRequestError
from lilo.futures.billing import check_window
from lilo.futures.store import Completion, FuturesStore, Submission

HOUR = 3600.0


def test_a_tenants_requests_become_hourly_events_per_session_and_base_model(ledger, clock):
    store = FuturesStore(ledger, clock=clock)
    clock.now = 10 * HOUR + 3599  # late in the hour: its bucket is still hour 10 (floored, never rounded)
    store.add_session("s1", tenant="acme")
    store.add_model("s1:train:0", "base-a", {"rank": 4}, tenant="acme", session_id="s1")
    store.add_sampling_session("s1:sample:0", "s1", "base-a", tenant="acme")
    step = store.submit(Submission("s1:train:0", "forward_backward", {}, seq_id=1, tenant="acme", billed_tokens=32))
    sample = store.submit(Submission("s1:sample:0", "sample", {}, seq_id=1, tenant="acme", billed_tokens=4))
    save = store.submit(Submission("s1:train:0", "save_weights", {}, seq_id=2, tenant="acme", billed_tokens=0))
    failed = store.submit(Submission("s1:train:0", "forward_backward", {"x": 1}, seq_id=3, tenant="acme",
                                     billed_tokens=99))
    store.add_model("s2:train:0", "base-a", {"rank": 4}, tenant="globex", session_id="s2")
    other = store.submit(Submission("s2:train:0", "forward", {}, seq_id=1, tenant="globex", billed_tokens=7))
    store.complete_many([Completion.success(step, b"", kind="forward_backward"),
                         Completion.success(sample, b"", kind="sample", sampled_tokens=6),
                         Completion.success(save, b"{}", kind="save_weights"),
                         Completion.failure(failed, "boom"), Completion.success(other, b"", kind="forward")])
    usage = store.billing_usage("acme", 10 * HOUR, 11 * HOUR)
    quantities = {row["event_info"]["type"]: row["event_info"].get("token_count", row["event_info"].get("count"))
                  for row in usage["data"]}
    assert quantities == {"training": 32, "sampling_prefill": 4, "sampling_sample": 6, "checkpoint": 1}
    assert {(row["session_id"], row["base_model"], row["bucket_start"]) for row in usage["data"]} == {
        ("s1", "base-a", "1970-01-01T10:00:00+00:00")}
    assert usage["sessions"] == {"s1": {"user_metadata": None}}
    assert store.billing_usage("acme", 11 * HOUR, 12 * HOUR)["data"] == []
    store.close()


@pytest.mark.parametrize("start, end, message", [
    ("2026-01-01T00:30:00", "2026-01-01T02:00:00", "whole UTC hours"),
    ("2026-01-01T02:00:00", "2026-01-01T01:00:00", "after starting_on"),
    ("2026-01-01T00:00:00", "2026-01-16T00:00:00", "at most 14 days"),
    ("2027-01-01T00:00:00", "2027-01-01T01:00:00", "in the future"),
])
def test_a_window_is_whole_hours_begun_at_most_two_weeks(start, end, message):
    def utc(text: str) -> datetime.datetime:
        return datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.timezone.utc)

    now = utc("2026-06-01T00:00:00").timestamp()
    with pytest.raises(InvalidRequestError, match=message):
        check_window(utc(start), utc(end), now)
    assert check_window(utc("2026-01-01T00:00:00"), utc("2026-01-02T00:00:00"), now)[1] - 86400 == utc(
        "2026-01-01T00:00:00").timestamp()
