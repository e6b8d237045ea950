"""Whose a record is: every session, model, sampling session and future carries the tenant (the API key's holder)
that created it. A record without one (written before tenants existed) belongs to the local tenant."""

from __future__ import annotations

# The one tenant of local mode (no API keys configured): every ``tml-`` key acts as it.
LOCAL_TENANT = "local"


def tenant_of(recorded: str | None) -> str:
    """The tenant a record belongs to, given its ``tenant`` column."""
    return recorded or LOCAL_TENANT


def may_see(caller: str | None, recorded: str | None) -> bool:
    """Whether ``caller`` may see a record of tenant ``recorded``; ``caller`` None is lilo itself, which sees all."""
    return caller is None or tenant_of(recorded) == caller
