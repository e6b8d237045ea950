"""Sessions as the SDK's RestClient reads them: ``list_sessions``, ``get_session`` and (experimental in the SDK)
``search_sessions``; the rules are in ``lilo.session_search``. Each answers with the SDK's shapes
(``ListSessionsResponse``, ``GetSessionResponse``, ``SessionSearchResponse``) and only the caller's sessions."""

from __future__ import annotations

import datetime
import time
from typing import Any, Sequence

from ray.actor import ActorHandle

from lilo.errors import InvalidRequestError
from lilo.session_search import SessionRow, display_name, project_id, status_of, user_metadata
from serve.runs import checkpoints_of, timestamp


async def list_sessions(futures: ActorHandle, limit: int, offset: int, tenant: str) -> dict[str, Any]:
    return {"sessions": await futures.session_page.remote(tenant, limit, offset)}


async def get_session(futures: ActorHandle, session_id: str, tenant: str) -> dict[str, Any]:
    row, runs, samplers = await futures.session_detail.remote(session_id, tenant)
    return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": user_metadata(row),
            "display_name": display_name(row)}


async def search_sessions(futures: ActorHandle, trainers: Sequence[str], query: dict[str, Any],
                          tenant: str) -> dict[str, Any]:
    """One page of the caller's sessions matching ``query`` (a ``SessionSearchRequest``), newest first, each with
    how many checkpoints its runs hold and their size."""
    limit = int(query.get("limit") or 50)
    rows, more = await futures.search_sessions.remote(tenant, query, limit, cursor_after(query.get("cursor")))
    runs = await futures.session_runs.remote([row.session_id for row in rows])
    checkpoints = await checkpoints_of(futures, [run for found in runs.values() for run in found], trainers)
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


def cursor_after(cursor: dict[str, Any] | None) -> tuple[float, str] | None:
    """The (created_at, session_id) a page's ``next_cursor`` points after."""
    if cursor is None:
        return None
    try:
        at = datetime.datetime.fromisoformat(str(cursor["last_created_at"]).replace("Z", "+00:00"))
        if at.tzinfo is None:
            raise ValueError("no time zone")
        return at.timestamp(), str(cursor["last_session_id"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise InvalidRequestError("cursor is not one a search returned; pass the previous page's next_cursor "
                                  "unchanged, or none for the first page.") from None
