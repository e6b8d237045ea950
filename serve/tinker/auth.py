"""The SDK's and the ``tinker`` CLI's auth routes: a key exchanged for a token (``auth/token``, lilo.session_tokens),
and a key's public metadata (``auth/apikey/me``, which ``tinker auth login`` checks a pasted key with). Keys are the
operator's (``--api-keys-file``, ``LILO_API_KEYS``), so no route creates or deletes one."""

from __future__ import annotations

import time
from typing import Any

from lilo.api_keys import digest
from lilo.errors import ForbiddenError
from lilo.session_tokens import SessionTokens


def exchanged(tokens: SessionTokens, tenant: str) -> dict[str, str]:
    """The SDK's ``AuthTokenResponse``: a token standing for the caller's key."""
    return {"jwt": tokens.mint(tenant, time.time())}


def key_details(key: str, tenant: str) -> dict[str, Any]:
    """The CLI's ``SelfApiKeyResponse`` for the key the caller presented. lilo knows a key's tenant and nothing
    else, so the tenant stands for the organization, and for the user an address that says it is no mailbox."""
    return {"key_id": int(digest(key)[:12], 16), "name": f"lilo key of {tenant}",
            "note": "configured by this server's operator",
            "details": {"org_details": {"name": tenant}, "user_details": {"email": f"{tenant}@lilo.invalid"}}}


def refuse_deletion() -> None:
    raise ForbiddenError("API keys are this server's operator's to remove (--api-keys-file or LILO_API_KEYS); the "
                         "key stays valid. Ask the operator to remove it.")
