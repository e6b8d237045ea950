"""What finished in a sampling session after a cursor: the ledger's side of the SDK's ``retrieve_futures``.

Every write that finishes futures stamps them with the next number of one counter (``FinishOrder``), kept by the
futures DB's single writer. A session's cursor is the highest number its client has seen, so a poll asks for the
session's samples numbered after it: one statement answers every poll parked at that moment, whatever their
sessions (``completions_after``). Rows a write finished together share a number and are always answered together,
so a page never ends inside one write.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from sqlalchemy import Engine, func, select

from lilo.futures.schema import futures

# The SDK numbers a sampling client's requests from clone_id * CLONE_SPAN (lilo.futures.schema: seq_id).
CLONE_SPAN = 1_000_000_000
# Completions one poll answers at most: a client polling an old session from cursor 0 gets them page by page.
PAGE = 4096
# Polls one statement answers at most: two bound parameters each, within SQLite's limit of 32,766.
MAX_TARGETS = 15_000
_QUERY = ("SELECT model_id, seq_id, request_id, status, length(result), finished_seq FROM futures "
          "WHERE kind = 'sample' AND ({terms}) ORDER BY finished_seq, request_id")
# A session's clones share its rows; the clone is told apart here, not in SQL, whose planner would then rather
# walk every row of the clone by seq (the unique index) than only those finished after the cursor.
_TERM = "(model_id = {mark} AND finished_seq > {mark})"


@dataclasses.dataclass(frozen=True)
class SessionTarget:
    """One sampling client's requests: a sampling session and the clone id the SDK numbers them under."""

    sampling_session_id: str
    clone: int = 0


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """A request of a session that finished: completed (with its result's size), or failed."""

    request_id: int
    completed: bool
    result_bytes: int

    def as_wire(self) -> dict:
        """The SDK's ``FutureFinished`` / ``FutureFailed``."""
        if not self.completed:
            return {"state": "failed", "request_id": str(self.request_id)}
        return {"state": "finished", "request_id": str(self.request_id),
                "response_payload_uncompressed_size": self.result_bytes}


class FinishOrder:
    """The counter finishing writes stamp their rows with; it starts past the highest number in the file."""

    def __init__(self, engine: Engine) -> None:
        with engine.connect() as connection:
            highest = connection.execute(select(func.max(futures.c.finished_seq))).scalar()
        self._numbers = itertools.count((highest or 0) + 1)

    def next(self) -> int:
        return next(self._numbers)


def completions_after(read, polls: Sequence[tuple[SessionTarget, int]], page: int = PAGE,
                      mark: str = "?") -> dict[tuple[SessionTarget, int], tuple[list[FinishedRequest], int]]:
    """For each (target, cursor): its samples finished after ``cursor``, oldest first, at most about a ``page``,
    and the cursor to poll with next. ``read(sql, params)`` runs one statement per ``MAX_TARGETS`` polls, with
    ``mark`` for each parameter (the driver's placeholder).

    A sample's row is found by its session (the ``model_id`` column) through a partial index of samples; the
    statement names ``kind = 'sample'`` as the index does, or SQLite would not use it."""
    found: dict[tuple[SessionTarget, int], list[tuple[int, FinishedRequest]]] = {poll: [] for poll in polls}
    by_session: dict[str, list[tuple[SessionTarget, int]]] = {}
    for poll in found:
        by_session.setdefault(poll[0].sampling_session_id, []).append(poll)
    distinct = list(found)
    term = _TERM.format(mark=mark)
    for start in range(0, len(distinct), MAX_TARGETS):
        chunk = distinct[start:start + MAX_TARGETS]
        params: list = []
        for target, cursor in chunk:
            params += [target.sampling_session_id, cursor]
        for model_id, seq_id, request_id, status, size, number in read(
                _QUERY.format(terms=" OR ".join([term] * len(chunk))), tuple(params)):
            request = FinishedRequest(request_id, status == "completed", size or 0)
            for target, cursor in by_session[model_id]:
                if number > cursor and seq_id // CLONE_SPAN == target.clone:
                    found[(target, cursor)].append((number, request))
    return {poll: _page(rows, poll[1], page) for poll, rows in found.items()}


def _page(rows: list[tuple[int, FinishedRequest]], cursor: int, page: int) -> tuple[list[FinishedRequest], int]:
    """The first ``page`` rows, and those numbered like the last of them (one write's rows stay together)."""
    if len(rows) > page:
        last = rows[page - 1][0]
        rows = [row for row in rows if row[0] <= last]
    return [request for _, request in rows], rows[-1][0] if rows else cursor
