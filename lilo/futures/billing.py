"""``tinker billing usage`` from the ledger: a tenant's usage in hourly buckets, per session and base model, in the
SDK's ``BillingUsageResponse`` shape. lilo bills nobody, so no event has a cost; the counts are what its requests
used: tokens of training passes (forward and forward_backward), prompt tokens and generated tokens of samples, and
checkpoints saved. The ledger keeps requests for its retention time (24 h by default), so older hours are empty;
``GET /api/v1/usage`` has each tenant's totals since the ledger was made."""

from __future__ import annotations

import datetime
from typing import Any, Sequence

from sqlalchemy import Engine, text

from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError

HOUR_S = 3600
MAX_WINDOW_S = 14 * 24 * HOUR_S
TRAINING = (Kind.FORWARD_BACKWARD, Kind.FORWARD)
CHECKPOINTS = (Kind.SAVE_WEIGHTS, Kind.SAVE_WEIGHTS_FOR_SAMPLER, Kind.SAVE_WEIGHTS_EXTERNAL)
# One row per (hour, session, base model, kind) of the tenant's finished requests in the window: a request's session
# and base model are its training run's, or its sampling session's.
_USAGE_SQL = """
SELECT {hour} AS hour, COALESCE(m.session_id, s.session_id) AS session,
       COALESCE(m.base_model, s.base_model) AS base, f.kind AS kind, COUNT(*) AS requests,
       SUM(f.billed_tokens) AS billed, SUM(f.sampled_tokens) AS sampled
FROM futures f
LEFT JOIN models m ON m.model_id = f.model_id
LEFT JOIN sampling_sessions s ON s.sampling_session_id = f.model_id
WHERE COALESCE(f.tenant, :local) = :tenant AND f.status = 'completed'
      AND f.submitted_at >= :start AND f.submitted_at < :end
GROUP BY hour, session, base, kind
"""
# The hour a time falls in: SQLite's CAST truncates (the same, for times after 1970), PostgreSQL's would round.
_USAGE = {"sqlite": text(_USAGE_SQL.format(hour="CAST(f.submitted_at / 3600 AS INTEGER)")),
          "postgresql": text(_USAGE_SQL.format(hour="CAST(FLOOR(f.submitted_at / 3600) AS BIGINT)"))}


def check_window(starting_on: datetime.datetime, ending_before: datetime.datetime, now: float) -> tuple[float, float]:
    """The window in seconds since the epoch, once it is whole UTC hours, not in the future, at most 14 days (a time
    without a zone is UTC)."""
    start, end = (moment.replace(tzinfo=moment.tzinfo or datetime.timezone.utc).timestamp()
                  for moment in (starting_on, ending_before))
    if start % HOUR_S or end % HOUR_S:
        raise InvalidRequestError("starting_on and ending_before must be whole UTC hours (minutes and seconds 0).")
    if start > now:
        raise InvalidRequestError("starting_on is in the future; ask for hours that have begun.")
    if not 0 < end - start <= MAX_WINDOW_S:
        raise InvalidRequestError("ending_before must come after starting_on, by at most 14 days.")
    return start, end


def usage_events(engine: Engine, tenant: str, local: str, start: float, end: float) -> dict[str, Any]:
    """The SDK's ``BillingUsageResponse`` for ``tenant`` (``local``: the tenant of requests recorded without one)."""
    with engine.connect() as connection:
        rows = connection.execute(_USAGE[engine.dialect.name],
                                  {"tenant": tenant, "local": local, "start": start, "end": end}).all()
    events = [event for row in rows for event in _events(row, tenant)]
    events.sort(key=lambda event: (event["bucket_start"], -_quantity(event["event_info"])))
    sessions = {event["session_id"]: {"user_metadata": None} for event in events if event["session_id"]}
    return {"data": events, "sessions": sessions, "cost_data_through": None}


def _events(row: Any, tenant: str) -> Sequence[dict[str, Any]]:
    infos: list[dict[str, Any]] = []
    if row.kind in TRAINING and row.billed:
        infos.append({"type": "training", "token_count": int(row.billed)})
    elif row.kind == Kind.SAMPLE:
        if row.billed:
            infos.append({"type": "sampling_prefill", "cached": False, "token_count": int(row.billed)})
        if row.sampled:
            infos.append({"type": "sampling_sample", "token_count": int(row.sampled)})
    elif row.kind in CHECKPOINTS:
        infos.append({"type": "checkpoint", "count": int(row.requests)})
    start = datetime.datetime.fromtimestamp(row.hour * HOUR_S, datetime.timezone.utc)
    return [{"bucket_start": start.isoformat(), "bucket_end": (start + datetime.timedelta(hours=1)).isoformat(),
             "base_model": row.base, "user_id": f"tml:user:{tenant}", "user_name": tenant,
             "session_id": row.session, "project_id": None, "estimated_cost_usd": None,
             "effective_rate_usd_per_million_tokens": None, "effective_rate_usd_per_gigabyte_month": None,
             "event_info": info} for info in infos]


def _quantity(info: dict[str, Any]) -> int:
    return info.get("token_count", info.get("count", 0))


def billed_tokens(kind: str, tokens: int, prompt: Sequence[int] | None = None) -> int:
    """What billing counts of a request at submit: a sample's prompt tokens, a training pass's tokens."""
    return len(prompt) if kind == Kind.SAMPLE and prompt is not None else tokens
