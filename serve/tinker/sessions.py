"""Sessions as the SDK's RestClient reads them: ``list_sessions``, ``get_session`` and (experimental in the SDK)
``search_sessions``; the rules are in ``lilo.session_search``. Each answers with the SDK's shapes
(``ListSessionsResponse``, ``GetSessionResponse``, ``SessionSearchResponse``) and only the caller's sessions."""

from __future__ import annotations

import datetime
import time
from typing import Any

from lilo.errors import InvalidRequestError
from lilo.session_search import SessionRow, display_name, project_id, status_of, user_metadata
from serve.tinker.actors import Actors
from serve.tinker.requests import SessionSearchCursor, SessionSearchRequest
from serve.tinker.runs import Runs, timestamp


class Sessions:
    """The caller's sessions (``runs``: to count their checkpoints)."""

    def __init__(self, actors: Actors, runs: Runs) -> None:
        self._futures = actors.futures
        self._runs = runs

    async def page(self, limit: int, offset: int, tenant: str) -> dict[str, Any]:
        return {"sessions": await self._futures.session_page.remote(tenant, limit, offset)}

    async def session(self, session_id: str, tenant: str) -> dict[str, Any]:
        row, runs, samplers = await self._futures.session_detail.remote(session_id, tenant)
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": user_metadata(row),
                "display_name": display_name(row)}

    async def search(self, request: SessionSearchRequest, tenant: str) -> dict[str, Any]:
        """One page of the caller's sessions matching ``request``, newest first, each with how many checkpoints its
        runs hold and their size."""
        # The futures DB filters with lilo.session_search, which cannot import serve's request models: it is handed
        # the query as JSON.
        query = request.model_dump(exclude={"limit", "cursor"})
        rows, more = await self._futures.search_sessions.remote(tenant, query, request.limit,
                                                                cursor_after(request.cursor))
        runs = await self._futures.session_runs.remote([row.session_id for row in rows])
        checkpoints = await self._runs.checkpoints_of([run for found in runs.values() for run in found])
        now = time.time()
        summaries = []
        for row in rows:
            held = [listed for run in runs[row.session_id] for listed in checkpoints.get(run["model_id"], [])]
            summaries.append(summary_json(row, now, len(held), sum(entry.size_bytes for entry, _ in held)))
        last = rows[-1] if more else None
        return {"sessions": summaries, "next_cursor": None if last is None else {
            "last_created_at": timestamp(last.created_at), "last_session_id": last.session_id}}


def summary_json(row: SessionRow, now: float, checkpoints_count: int, storage_bytes: int) -> dict[str, Any]:
    """A session as the SDK's ``SessionSummary``."""
    return {"session_id": row.session_id, "created_at": timestamp(row.created_at), "owner": row.tenant,
            "project_id": project_id(row), "status": status_of(row, now), "checkpoints_count": checkpoints_count,
            "display_name": display_name(row), "user_metadata": user_metadata(row),
            "checkpoint_storage_bytes": storage_bytes}


def cursor_after(cursor: SessionSearchCursor | None) -> tuple[float, str] | None:
    """The (created_at, session_id) a page's ``next_cursor`` points after."""
    if cursor is None:
        return None
    try:
        at = datetime.datetime.fromisoformat(cursor.last_created_at.replace("Z", "+00:00"))
        if at.tzinfo is None:
            raise ValueError("no time zone")
        return at.timestamp(), cursor.last_session_id
    except (ValueError, OverflowError):
        raise InvalidRequestError("cursor is not one a search returned; pass the previous page's next_cursor "
                                  "unchanged, or none for the first page.") from None
