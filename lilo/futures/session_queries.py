"""Sessions as the RestClient reads them (``lilo.session_search``), from the futures database: listing, one
session's runs and samplers, search pages, and recording how a client closed its session."""

from __future__ import annotations

from typing import Any, Sequence

import orjson
from sqlalchemy import Engine, and_, func, or_, select, true, update

from lilo.errors import NotFoundError
from lilo.futures.schema import futures, models, sampling_sessions, sessions
from lilo.session_search import SessionRow, matches
from lilo.tenants import LOCAL_TENANT, may_see, tenant_of

SCAN_CHUNK = 500  # sessions read per query while a search fills its page


def unknown_session_error(session_id: str) -> NotFoundError:
    """What an unknown session answers, and (so its existence is not revealed) another tenant's."""
    return NotFoundError(f"Unknown session_id {session_id!r}; create a session first.")


class SessionQueries:
    """Read (and for ``record_finish``, write) sessions; called on the futures DB's one writer thread."""

    def __init__(self, engine: Engine, clock) -> None:
        self._engine = engine
        self._clock = clock

    def record_finish(self, session_id: str, tenant: str | None, finished: dict[str, Any]) -> None:
        with self._engine.begin() as connection:
            connection.execute(update(sessions).where(sessions.c.session_id == session_id, _mine(tenant))
                               .values(finished=orjson.dumps(finished).decode()))

    def page(self, tenant: str, limit: int, offset: int) -> list[str]:
        """One page of the tenant's session ids, newest first."""
        with self._engine.connect() as connection:
            return list(connection.execute(select(sessions.c.session_id).where(_mine(tenant)).order_by(*_NEWEST)
                                           .limit(limit).offset(offset)).scalars())

    def detail(self, session_id: str, tenant: str) -> tuple[SessionRow, list[str], list[str]]:
        """(the session, its training run ids, its sampler ids), or 404 unless it is one of ``tenant``'s."""
        with self._engine.connect() as connection:
            row = connection.execute(select(sessions).where(sessions.c.session_id == session_id)).mappings().first()
            if row is None or not may_see(tenant, row["tenant"]):
                raise unknown_session_error(session_id)
            runs = connection.execute(select(models.c.model_id).where(models.c.session_id == session_id)
                                      .order_by(models.c.created_at, models.c.model_id)).scalars().all()
            samplers = connection.execute(
                select(sampling_sessions.c.sampling_session_id).where(sampling_sessions.c.session_id == session_id)
                .order_by(sampling_sessions.c.created_at, sampling_sessions.c.sampling_session_id)).scalars().all()
        return _row(row), list(runs), list(samplers)

    def search(self, tenant: str, query: dict[str, Any], limit: int,
               after: tuple[float, str] | None) -> tuple[list[SessionRow], bool]:
        """Up to ``limit`` of the tenant's sessions matching ``query``, newest first, after the cursor ``after``
        (created_at, session_id); and whether more match."""
        found: list[SessionRow] = []
        now = self._clock()
        with self._engine.connect() as connection:
            while len(found) <= limit:
                statement = select(sessions).where(_mine(tenant)).order_by(*_NEWEST).limit(SCAN_CHUNK)
                if after is not None:
                    # In whole microseconds: a cursor's time went through an ISO timestamp, which keeps no more.
                    micros, at = func.round(sessions.c.created_at * 1e6), round(after[0] * 1e6)
                    statement = statement.where(or_(micros < at, and_(micros == at,
                                                                      sessions.c.session_id < after[1])))
                rows = [_row(row) for row in connection.execute(statement).mappings()]
                found += [row for row in rows if matches(query, row, now)]
                if len(rows) < SCAN_CHUNK:
                    break
                after = (rows[-1].created_at, rows[-1].session_id)
        return found[:limit], len(found) > limit

    def requests(self, session_id: str, tenant: str, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` requests of the session's training runs and sampling sessions, oldest first; 404
        unless the session is one of ``tenant``'s."""
        _, runs, samplers = self.detail(session_id, tenant)
        columns = (futures.c.model_id, futures.c.kind, futures.c.request_id, futures.c.seq_id, futures.c.status,
                   futures.c.submitted_at, futures.c.finished_at, futures.c.trainer, futures.c.error)
        with self._engine.connect() as connection:
            return [dict(row) for row in connection.execute(
                select(*columns).where(futures.c.model_id.in_([*runs, *samplers]))
                .order_by(futures.c.request_id).limit(limit)).mappings()]

    def runs_of(self, session_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """session -> its runs' ``model_id`` and ``trainer`` (to count their checkpoints)."""
        runs: dict[str, list[dict[str, Any]]] = {session_id: [] for session_id in session_ids}
        with self._engine.connect() as connection:
            for row in connection.execute(select(models.c.model_id, models.c.trainer, models.c.session_id)
                                          .where(models.c.session_id.in_(list(session_ids)))).mappings():
                runs[row["session_id"]].append({"model_id": row["model_id"], "trainer": row["trainer"]})
        return runs


_NEWEST = (sessions.c.created_at.desc(), sessions.c.session_id.desc())


def _mine(tenant: str | None) -> Any:
    return true() if tenant is None else func.coalesce(sessions.c.tenant, LOCAL_TENANT) == tenant


def _row(row: Any) -> SessionRow:
    return SessionRow(row["session_id"], tenant_of(row["tenant"]), row["created_at"], row["last_heartbeat_at"],
                      orjson.loads(row["metadata"] or "{}"),
                      None if row["finished"] is None else orjson.loads(row["finished"]))
