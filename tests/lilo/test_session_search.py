"""Sessions as the RestClient searches them: the matching rules, the status, and pages over a real SQLite file."""

import pytest

from lilo.futures.store import FuturesStore
from lilo.session_search import ACTIVE_WITHIN_S, SessionRow, matches, status_of

NOW = 10_000.0
ROW = SessionRow("session-1", "alpha", 100.0, NOW - 5,
                 {"display_name": "Nightly Sweep run", "project_id": "proj-a", "user_metadata": {"team": "rl"}})
FINISHED = SessionRow("session-2", "alpha", 90.0, NOW - 5, {}, {"reason": {"type": "errored"}, "detail": "oom"})


@pytest.mark.parametrize(("query", "expected"), [
    ({}, True),
    ({"session_id": "session-1"}, True),
    ({"session_id": "session-9"}, False),
    ({"display_name": "sweep NIGHTLY"}, True),  # every word, anywhere, ignoring case
    ({"display_name": "daily"}, False),
    ({"session_id": "session-9", "display_name": "nightly"}, True),  # either of the two
    ({"project_ids": ["proj-a", "proj-b"]}, True),
    ({"project_ids": ["proj-b"]}, False),
    ({"user_metadata": {"team": "rl"}}, True),
    ({"user_metadata": {"team": "sl"}}, False),
    ({"owner": {"type": "accessible"}}, True),
    ({"owner": {"type": "user", "owner_urns": ["tml:user:alpha"]}}, True),
    ({"owner": {"type": "user", "owner_urns": ["tml:user:beta"]}}, False),
    ({"statuses": [{"type": "active"}]}, True),
    ({"statuses": [{"type": "client_finished"}, {"type": "failed"}]}, False),
])
def test_a_search_matches_by_every_filter_given(query, expected):
    assert matches(query, ROW, NOW) is expected


def test_a_session_is_active_while_it_beats_and_finished_once_its_client_closed_it():
    assert status_of(ROW, NOW) == {"type": "active"}
    assert status_of(ROW, NOW + ACTIVE_WITHIN_S + 10) is None
    assert status_of(FINISHED, NOW) == {"type": "client_finished", "reason": {"type": "errored"}, "detail": "oom"}
    assert matches({"statuses": [{"type": "client_finished", "reasons": ["errored"]}]}, FINISHED, NOW)
    assert not matches({"statuses": [{"type": "client_finished", "reasons": ["success"]}]}, FINISHED, NOW)


def test_search_pages_follow_the_cursor_newest_first_over_the_callers_sessions_only(tmp_path, clock):
    store = FuturesStore(tmp_path / "futures.db", clock=clock)
    for i in range(7):
        clock.now += 1
        store.add_session(f"session-{i}", tenant="alpha", info={"display_name": "even" if i % 2 == 0 else "odd"})
    store.add_session("session-beta", tenant="beta", info={"display_name": "even"})
    sessions = store.sessions
    pages, after = [], None
    while True:
        rows, more = sessions.search("alpha", {"display_name": "even"}, 2, after)
        pages.append([row.session_id for row in rows])
        if not more:
            break
        after = (rows[-1].created_at, rows[-1].session_id)
    assert pages == [["session-6", "session-4"], ["session-2", "session-0"]]
    assert sessions.page("alpha", 3, 1) == ["session-5", "session-4", "session-3"]
    store.add_model("session-3:train:0", "lilo/tiny-llama", {}, tenant="alpha", session_id="session-3")
    store.add_sampling_session("session-3:sample:0", "session-3", "lilo/tiny-llama", tenant="alpha")
    row, runs, samplers = sessions.detail("session-3", "alpha")
    assert (row.info["display_name"], runs, samplers) == ("odd", ["session-3:train:0"], ["session-3:sample:0"])
    sessions.record_finish("session-3", "beta", {"reason": {"type": "success"}})  # not beta's: nothing happens
    assert sessions.detail("session-3", "alpha")[0].finished is None
    sessions.record_finish("session-3", "alpha", {"reason": {"type": "success"}, "detail": None})
    assert status_of(sessions.detail("session-3", "alpha")[0], clock.now)["type"] == "client_finished"
    with pytest.raises(Exception, match="Unknown session_id 'session-3'"):
        sessions.detail("session-3", "beta")
    store.close()
