"""The coalescing window: how long a pass that could start now waits for the next commands of the models stepping
in rhythm with it, so that clients in lockstep (each sends its step, waits for its result, sends the next) share
one pass, instead of the first to arrive running alone while the others, milliseconds behind, wait for a second.

A client's rhythm is its *think time*: from the moment its model went idle (its last command finished) to its next
command of a kind. Unlike the period between its steps, that does not change when coalescing changes how long its
steps take. ``Rhythm`` keeps it per model and kind, and each kind's pass duration; ``window_s`` and ``awaited`` are
the decision, pure functions of that data. The rules (``tests/lilo/test_window.py`` states each):
- the wait never exceeds ``WINDOW_SHARE_OF_PASS`` of the kind's recent pass duration, nor the configured cap;
- a model is waited for only while idle, with its next command due (idle since + think time) by the window's end;
- a model later than its think time again is not in rhythm any more (it stopped, or is doing something else);
- a model whose last command would not fit the pass's token budget is not waited for;
- with no other model in rhythm (a lone client) there is no window at all, so it costs nothing;
- a pass full of commands of tenants served more than another (``lilo.engine.fair_share``) whose model is due
  waits longer, up to ``FAIR_WINDOW_SHARE_OF_PASS`` of a pass (at most ``FAIR_WINDOW_CAP_S``): that model's command
  takes a place of theirs, so a lockstep client of a tenant with few models still gets its tenant's share.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from typing import Mapping

from lilo.engine.commands import Kind

# The kinds whose passes wait for models in rhythm (samples take their own turn, one generation each).
WINDOW_KINDS = frozenset({Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.OPTIM_STEP})
# The longest a pass waits, as a share of the duration of its kind's recent passes: on a GPU a pass of 8 adapters
# costs little more than one, so a wait this short for the rest of a lockstep round pays for itself many times.
WINDOW_SHARE_OF_PASS = 0.25
DEFAULT_WINDOW_CAP_MS = 100.0
# The window of a full pass that a less served tenant's due command would take a place in (the last rule above).
FAIR_WINDOW_SHARE_OF_PASS = 1.0
FAIR_WINDOW_CAP_S = 1.0
# Think times remembered per model and kind; their median is the model's rhythm, so one pause (an evaluation
# between steps) does not throw it off.
THINKS_KEPT = 5
# Weight of the newest pass in the moving average of a kind's pass duration.
PASS_SMOOTHING = 0.3


@dataclasses.dataclass(frozen=True)
class Expected:
    """When an idle model's next command of a kind is due, from its rhythm."""

    due_s: float  # idle since + its usual think time
    think_s: float
    tokens: int  # its last command's, what the next will likely count against the budget


class Rhythm:
    """Per (model, kind) the recent think times and the last command's tokens; per kind the pass duration. The
    engine feeds and reads it under its lock (passes from its compute lane, which is also where it reads)."""

    def __init__(self) -> None:
        self._thinks: dict[tuple[str, str], deque[float]] = {}
        self._tokens: dict[tuple[str, str], int] = {}
        self._pass_s: dict[str, float] = {}

    def learn(self, model_id: str, kind: str, think_s: float, tokens: int) -> None:
        """A command of ``kind`` arrived ``think_s`` after ``model_id`` went idle."""
        if kind not in WINDOW_KINDS:
            return
        key = (model_id, kind)
        self._thinks.setdefault(key, deque(maxlen=THINKS_KEPT)).append(max(0.0, think_s))
        self._tokens[key] = tokens

    def expected(self, model_id: str, kind: str, idle_since_s: float) -> Expected | None:
        """When ``model_id``, idle since ``idle_since_s``, should send its next ``kind`` (None: never sent one
        after going idle)."""
        thinks = self._thinks.get((model_id, kind))
        if not thinks:
            return None
        think = statistics.median(thinks)
        return Expected(idle_since_s + think, think, self._tokens[(model_id, kind)])

    def passed(self, kind: str, seconds: float) -> None:
        previous = self._pass_s.get(kind)
        self._pass_s[kind] = seconds if previous is None else previous + PASS_SMOOTHING * (seconds - previous)

    def pass_s(self, kind: str) -> float | None:
        """The smoothed duration of ``kind``'s recent passes (None before the first)."""
        return self._pass_s.get(kind)

    def forget(self, model_id: str) -> None:
        for key in [key for key in self._thinks if key[0] == model_id]:
            del self._thinks[key], self._tokens[key]


def window_s(pass_s: float | None, cap_s: float, share: float = WINDOW_SHARE_OF_PASS) -> float:
    """The longest a pass of a kind whose recent passes took ``pass_s`` may wait (0: it runs at once)."""
    if pass_s is None or cap_s <= 0:
        return 0.0
    return min(cap_s, share * pass_s)


def awaited(expected: Mapping[str, Expected | None], now_s: float, deadline_s: float,
            room_tokens: int | None) -> list[str]:
    """Which of the idle models in ``expected`` a pass holding its window open until ``deadline_s`` waits for:
    those in rhythm (not later than their think time again) whose next command is due by the deadline and whose
    last one fits ``room_tokens`` (None: no token budget)."""
    waited = []
    for model_id, beat in expected.items():
        if beat is None:
            continue
        in_rhythm = now_s - beat.due_s <= beat.think_s
        fits = room_tokens is None or beat.tokens <= room_tokens
        if in_rhythm and beat.due_s <= deadline_s and fits:
            waited.append(model_id)
    return waited
