"""The tenants' rate limits at the door: requests in flight and tokens per minute, checked as the futures DB records
each request (the one place every request passes), so they hold cluster-wide whatever ingress replica took it.

A request over a limit is refused before it is recorded, with a RateLimitedError (429, Retry-After) the SDK waits
out and sends again; nothing recorded is ever refused, so what was accepted keeps its place and order. The counts
are in memory: in-flight ones from what was recorded and what finished (recounted from the file every few seconds,
so futures failed by other paths do not leave them high), token windows over the last minute.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Callable, Mapping

from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError, RateLimitedError
from lilo.tenant_policy import TenantLimits

WINDOW_S = 60.0
TRAINING_KINDS = frozenset({Kind.FORWARD_BACKWARD, Kind.FORWARD})
# How long a tenant at its in-flight limit is told to wait: about one step of a small model.
INFLIGHT_RETRY_S = 1.0
# What lilo records itself, never refused: a refusal holding a spent seq's place (refusing it would leave the model's
# next request waiting for that seq), and unloads.
NEVER_LIMITED = frozenset({Kind.REFUSED, Kind.UNLOAD_MODEL})


class TokenWindow:
    """Tokens admitted over the last minute."""

    def __init__(self) -> None:
        self._entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        while self._entries and self._entries[0][0] <= now - WINDOW_S:
            self.total -= self._entries.popleft()[1]

    def add(self, now: float, tokens: int) -> None:
        self._entries.append((now, tokens))
        self.total += tokens

    def wait_for(self, now: float, room_needed: int) -> float:
        """Seconds until at least ``room_needed`` of the window's tokens have aged out."""
        freed = 0
        for at, tokens in self._entries:
            freed += tokens
            if freed >= room_needed:
                return max(at + WINDOW_S - now, 0.0)
        return WINDOW_S


class Admission:
    """Per tenant: requests in flight and token windows, against its limits."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.inflight: Counter[str] = Counter()
        self._windows: dict[tuple[str, str], TokenWindow] = {}
        self._usage: dict[str, Counter] = {}  # admitted since the last take_usage

    def check(self, tenant: str, limits: TenantLimits, kind: str, tokens: int) -> None:
        """Raises RateLimitedError when a new request of ``kind`` with ``tokens`` would put ``tenant`` over a rate
        limit (InvalidRequestError when it alone is over one: waiting would not help)."""
        if kind in NEVER_LIMITED:
            return
        if limits.max_inflight is not None and self.inflight[tenant] >= limits.max_inflight:
            raise RateLimitedError(
                f"Tenant {tenant!r} has {self.inflight[tenant]} requests in flight, its limit (max_inflight "
                f"{limits.max_inflight} in the tenants file); this one is refused for now: send it again once "
                "some finish (the SDK does so by itself).", INFLIGHT_RETRY_S)
        rate, limit = self._rate(kind, limits)
        if limit is None or not tokens:
            return
        if tokens > limit:
            raise InvalidRequestError(
                f"This request has {tokens} tokens, more than tenant {tenant!r} may send in a minute ({rate} "
                f"{limit} in the tenants file); split it into smaller requests.")
        window = self._window(tenant, rate)
        now = self._clock()
        window.expire(now)
        if window.total + tokens > limit:
            wait = window.wait_for(now, window.total + tokens - limit)
            raise RateLimitedError(
                f"Tenant {tenant!r} sent {window.total} tokens in the last minute and this request has {tokens}, "
                f"over its {rate} of {limit} (the tenants file); send it again in {math.ceil(wait)} s (the SDK "
                "waits and does so by itself).", wait)

    def admitted(self, tenant: str, kind: str, tokens: int) -> None:
        """A new request of ``tenant`` was recorded (not a retry of one already recorded)."""
        self.inflight[tenant] += 1
        usage = self._usage.setdefault(tenant, Counter())
        usage["requests"] += 1
        rate, _ = self._rate(kind, None)
        if rate is not None and tokens:
            self._window(tenant, rate).add(self._clock(), tokens)
            usage["train_tokens" if rate == "train_tokens_per_min" else "sample_tokens"] += tokens

    def take_usage(self) -> dict[str, dict[str, int]]:
        """What was admitted since the last call, per tenant (tokens of each rate, requests), to add to the file."""
        taken, self._usage = self._usage, {}
        return {tenant: dict(counts) for tenant, counts in taken.items()}

    def unwritten(self) -> dict[str, Counter]:
        """What ``take_usage`` would give now, left in place."""
        return self._usage

    def finished(self, tenants: Mapping[int, str | None]) -> None:
        """Requests that were pending finished (request id -> tenant)."""
        for tenant in tenants.values():
            if tenant is not None and self.inflight[tenant] > 0:
                self.inflight[tenant] -= 1

    def recount(self, pending: Mapping[str, int]) -> None:
        """The pending requests per tenant, as the file has them."""
        self.inflight = Counter(pending)

    def _window(self, tenant: str, rate: str) -> TokenWindow:
        return self._windows.setdefault((tenant, rate), TokenWindow())

    @staticmethod
    def _rate(kind: str, limits: TenantLimits | None) -> tuple[str | None, int | None]:
        """Which rate a request of ``kind`` counts against, and the limit of it (None: none)."""
        if kind in TRAINING_KINDS:
            return "train_tokens_per_min", limits.train_tokens_per_min if limits else None
        if kind == Kind.SAMPLE:
            return "sample_tokens_per_min", limits.sample_tokens_per_min if limits else None
        return None, None
