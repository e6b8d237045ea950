"""``tinker session export-trace``: a session's timeline (lilo.timing.session_trace) behind a signed link, as the
SDK polls for it (``GET sessions/{id}/trace_export`` answers ready at once with the link) and downloads it (the link
needs no key: its signature, for the tenant and the session, is the credential; lilo.signed_urls). The trace is
built when the link is fetched, from the ledger and the runs' critical paths, so it is as fresh as the download."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote, urlencode

from lilo.errors import ForbiddenError
from lilo.signed_urls import LINK_LIFETIME_S, DownloadGrant, refusal, signature
from lilo.timing.critical_path import flatten
from lilo.timing.session_trace import MAX_REQUESTS, session_trace
from serve.tinker.actors import Actors
from serve.tinker.timing import Timing

TRACE_ROUTE = "/api/v1/downloads/session_traces"
TRACE_FILE = "trace.pftrace"
READER = "lilo-session-trace"  # the critical path's reader for exports: taking a trace resets no one else's interval


def _grant(tenant: str, session_id: str, expires_at: int) -> DownloadGrant:
    return DownloadGrant(tenant, f"session:{session_id}", TRACE_FILE, expires_at)


class SessionTraces:
    def __init__(self, actors: Actors, timing: Timing, url_secret: bytes) -> None:
        self._futures = actors.futures
        self._timing = timing
        self._secret = url_secret

    async def export(self, session_id: str, tenant: str, base_url: str) -> dict[str, Any]:
        """The SDK's trace-export poll: ready, with a signed link valid ``LINK_LIFETIME_S``; 404 for a session that
        is not the caller's."""
        await self._futures.session_detail.remote(session_id, tenant)
        expires_at = int(time.time()) + LINK_LIFETIME_S
        query = urlencode({"tenant": tenant, "expires": expires_at,
                           "signature": signature(self._secret, _grant(tenant, session_id, expires_at))})
        return {"status": "ready", "url": f"{base_url.rstrip('/')}{TRACE_ROUTE}/{quote(session_id, safe='')}?{query}"}

    async def download(self, session_id: str, tenant: str, expires: int, offered: str) -> bytes:
        """The trace a signed link names, once its signature and expiry are checked (403)."""
        why = refusal(self._secret, _grant(tenant, session_id, expires), offered, time.time(), "export_session_trace")
        if why is not None:
            raise ForbiddenError(why)
        requests = await self._futures.session_requests.remote(session_id, tenant, MAX_REQUESTS)
        paths = {}
        for model_id in dict.fromkeys(row["model_id"] for row in requests):
            snapshot = await self._timing.known(model_id, READER, tenant)
            if snapshot is not None:
                paths[model_id] = flatten(snapshot)
        return session_trace(session_id, requests, paths, time.time())
