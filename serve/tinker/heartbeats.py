"""Session heartbeats, answered by the API replica from its own memory.

A heartbeat only says "this client is alive", but every SDK client sends one every 10 s and reads its latency as
the service's health. So it is answered where it arrives: the first heartbeat of a session on this replica asks the
futures DB actor whether the session is the caller's (404 if not: unknown, or another tenant's); later ones are
checked against that answer and noted in memory. The times go to the futures DB actor in one call per second,
which writes them with its own every few seconds; session expiry (``--session-timeout``, an hour by default) reads
them there. A replica that dies loses at most a second of heartbeats, which the clients' next ones replace.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.actor import ActorHandle

from lilo.futures.store import merge_heartbeats, unknown_session_error

logger = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0
MAX_KNOWN_SESSIONS = 100_000


class SessionBeats:
    def __init__(self, futures: ActorHandle) -> None:
        self._futures = futures
        self._tenants: dict[str, str] = {}  # sessions known to exist -> their tenant
        self._beats: dict[str, float] = {}  # session -> its latest heartbeat, not yet handed to the futures DB
        self._flusher: asyncio.Task | None = None

    async def beat(self, session_id: str, tenant: str) -> None:
        """Note a heartbeat of ``session_id`` from ``tenant``; NotFoundError unless it is that tenant's session."""
        known = self._tenants.get(session_id)
        if known is None:
            await self._futures.check_session.remote(session_id, tenant)
            if len(self._tenants) >= MAX_KNOWN_SESSIONS:
                self._tenants.clear()
            self._tenants[session_id] = tenant
        elif known != tenant:
            raise unknown_session_error(session_id)
        self._beats[session_id] = time.time()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._hand_over())

    async def _hand_over(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            beats, self._beats = self._beats, {}
            if not beats:
                continue
            try:
                await self._futures.note_heartbeats.remote(beats)
            except Exception:  # the futures DB actor restarting: the next round takes these along
                logger.warning("handing %d session heartbeat(s) to the futures DB failed; trying again", len(beats))
                merge_heartbeats(self._beats, beats)
