"""Each tenant's usage, gathered: what the futures DB counted (tokens, requests, models, requests in flight, its
limits) and its share of every trainer's execute seconds (``TenantUsage``, since each trainer started)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

# How long a usage query waits for a trainer's answer before leaving it out.
TRAINER_ANSWER_S = 5.0


def merge_usage(counted: Mapping[str, dict[str, Any]], trainers: Iterable[Mapping[str, Mapping[str, float]] | None],
                tenant: str | None = None) -> dict[str, dict[str, Any]]:
    """The futures DB's ``usage`` with each tenant's ``execute_s`` and ``commands`` summed over the trainers'
    answers (None: a trainer that did not answer); only ``tenant``'s when given."""
    merged = {owner: {**row, "execute_s": 0.0, "commands": 0} for owner, row in counted.items()}
    for answer in trainers:
        for owner, share in (answer or {}).items():
            if tenant is not None and owner != tenant:
                continue
            row = merged.setdefault(owner, {"execute_s": 0.0, "commands": 0})
            row["execute_s"] += share["execute_s"]
            row["commands"] += share["commands"]
    for row in merged.values():
        row["execute_s"] = round(row["execute_s"], 3)
    return merged
