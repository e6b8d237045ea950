"""Finished futures pushed to the ingress replica that submitted them, so that its client's ``retrieve_future`` is
answered there, with no actor call of its own.

A replica names itself (a *subscriber*) when it submits; the futures DB remembers which replica submitted each
pending request and, as each result comes in, puts it in that replica's box (while the result is being written:
the futures DB writes it in the end, cluster.futures_actor). The replica takes its box with one long-poll (``take``)
per batch of results, instead of one call per retrieve. Nothing here is durable: a restarted futures DB has no
subscriptions, and its replicas then ask it as before (``serve.tinker.pushed_results``).
"""

from __future__ import annotations

import asyncio
import collections

from lilo.futures.store import Completion, FutureState

# Requests remembered as pending per subscriber, and results kept in a box nobody takes (its replica is gone):
# past these the oldest are forgotten, and their retrieves ask the futures DB as they would without pushes.
MAX_SUBSCRIBED = 100_000
MAX_BOX = 10_000


class FinishedPushes:
    def __init__(self, max_subscribed: int = MAX_SUBSCRIBED, max_box: int = MAX_BOX) -> None:
        # Each pending request pushed: its subscriber and its tenant.
        self._subscriber_of: collections.OrderedDict[int, tuple[str, str | None]] = collections.OrderedDict()
        self._boxes: dict[str, collections.deque[FutureState]] = {}
        self._filled: dict[str, asyncio.Event] = {}
        self._max_subscribed = max_subscribed
        self._max_box = max_box

    def subscribe(self, request_id: int, subscriber: str, tenant: str | None = None) -> None:
        """``subscriber`` wants ``request_id`` (``tenant``'s) pushed once it has its result."""
        self._subscriber_of[request_id] = (subscriber, tenant)
        while len(self._subscriber_of) > self._max_subscribed:
            self._subscriber_of.popitem(last=False)

    def push_completion(self, completion: Completion) -> FutureState | None:
        """``push`` the state ``completion`` makes of its request, if it has a subscriber (each request is pushed
        once: whatever comes later for it is not); returns the state pushed."""
        subscribed = self._subscriber_of.get(completion.request_id)
        if subscribed is None:
            return None
        state = FutureState.of(completion, subscribed[1])
        self.push(state)
        return state

    def push(self, state: FutureState) -> None:
        """A request has its result: into its subscriber's box, if it has one."""
        subscribed = self._subscriber_of.pop(state.request_id, None)
        if subscribed is None:
            return
        subscriber = subscribed[0]
        box = self._boxes.setdefault(subscriber, collections.deque(maxlen=self._max_box))
        box.append(state)
        self._event(subscriber).set()

    async def take(self, subscriber: str, timeout_s: float) -> list[FutureState]:
        """Everything pushed to ``subscriber`` since it last took, once there is something or after ``timeout_s``
        (then maybe nothing). A subscriber may keep several takes waiting: each push wakes them all, the first
        empties the box and the others wait on for the next."""
        filled = self._event(subscriber)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._boxes.get(subscriber):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return []
            try:
                await asyncio.wait_for(filled.wait(), left)
            except TimeoutError:
                return []
            filled.clear()
        return list(self._boxes.pop(subscriber))

    def _event(self, subscriber: str) -> asyncio.Event:
        return self._filled.setdefault(subscriber, asyncio.Event())
