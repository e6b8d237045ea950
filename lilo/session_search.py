"""Sessions as the SDK's ``RestClient`` lists, shows and searches them: pure functions over session rows.

A session row keeps what ``create_session`` sent (``tags``, ``user_metadata``, ``display_name``, ``project_id``), its
heartbeat and, once its client closed it, how it finished. Status: ``client_finished`` after the client's close;
``active`` while it beats (within ``ACTIVE_WITHIN_S``); else none (its client stopped without closing). lilo has no
console, so no session is ever ``cancelled``, and a session is never ``failed`` as a whole.

Searching sees the caller's own sessions only (tenants never see each other's), whatever ``owner`` says: ``own`` and
``accessible`` are the same here, and ``user`` matches when one of its ``owner_urns`` names the caller.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ACTIVE_WITHIN_S = 60.0  # the SDK beats every 10 s
URN_PREFIX = "tml:user:"


@dataclasses.dataclass(frozen=True)
class SessionRow:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat_at: float
    info: dict[str, Any]  # what create_session sent
    finished: dict[str, Any] | None = None  # {"reason": {"type": ...}, "detail": ...} once the client closed it


def user_urn(tenant: str) -> str:
    return f"{URN_PREFIX}{tenant}"


def status_of(row: SessionRow, now: float) -> dict[str, Any] | None:
    """The SDK's ``SessionStatus`` of a session, or None when it neither finished nor is known to be running."""
    if row.finished is not None:
        return {"type": "client_finished", "reason": row.finished.get("reason") or {"type": "success"},
                "detail": row.finished.get("detail")}
    if now - row.last_heartbeat_at <= ACTIVE_WITHIN_S:
        return {"type": "active"}
    return None


def user_metadata(row: SessionRow) -> dict[str, str] | None:
    raw = row.info.get("user_metadata")
    return {str(key): str(value) for key, value in raw.items()} if isinstance(raw, dict) else None


def display_name(row: SessionRow) -> str | None:
    name = row.info.get("display_name")
    return name if isinstance(name, str) else None


def project_id(row: SessionRow) -> str:
    """The project the client named at create_session (``TINKER_PROJECT_ID``); "" when it named none. lilo keeps no
    projects: the name is only recorded, and searched by."""
    project = row.info.get("project_id")
    return project if isinstance(project, str) else ""


def matches(query: dict[str, Any], row: SessionRow, now: float) -> bool:
    """Whether one of the caller's sessions matches a ``SessionSearchRequest`` (as a dict)."""
    return (_matches_name_or_id(query, row) and _matches_owner(query.get("owner") or {}, row)
            and (query.get("project_ids") is None or project_id(row) in query["project_ids"])
            and all((user_metadata(row) or {}).get(key) == value
                    for key, value in (query.get("user_metadata") or {}).items())
            and (query.get("statuses") is None or any(_matches_status(wanted, status_of(row, now))
                                                       for wanted in query["statuses"])))


def _matches_name_or_id(query: dict[str, Any], row: SessionRow) -> bool:
    """``session_id`` exactly and ``display_name`` by words: with both given, a session matching either matches."""
    tests = []
    if query.get("session_id") is not None:
        tests.append(row.session_id == query["session_id"])
    if query.get("display_name") is not None:
        name = (display_name(row) or "").lower()
        tests.append(all(word in name for word in query["display_name"].lower().split()))
    return not tests or any(tests)


def _matches_owner(owner: dict[str, Any], row: SessionRow) -> bool:
    if owner.get("type") == "user":
        return any(urn in (row.tenant, user_urn(row.tenant)) for urn in owner.get("owner_urns") or ())
    return True


def _matches_status(wanted: dict[str, Any], status: dict[str, Any] | None) -> bool:
    if status is None or wanted.get("type") != status["type"]:
        return False
    reasons = wanted.get("reasons")
    return reasons is None or status.get("reason", {}).get("type") in reasons
