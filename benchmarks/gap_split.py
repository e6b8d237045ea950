"""Where the gap between a lockstep step's passes goes, read from one run's traces (docs/timing.md, "Traces").

Between a trainer's optim_step pass and its next forward_backward pass, K lockstep clients' results go out and
their next forward_backwards come in. ``gap_split`` follows each such gap through the spans lilo exports: from the
optim_step pass's end to the results written, to the first and the last next request reaching the ingress, to the
last of them recorded by the futures DB, to the last handed to the trainer, and to the next pass's start.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Protocol

FORWARD_BACKWARD_ROUTE = "POST /api/v1/forward_backward"
# Milliseconds from the optim_step pass's end, in the order a gap's requests reach them.
MILESTONES = ("results_written", "first_request_in", "last_request_in", "last_recorded", "last_handed_over",
              "next_pass")


class Span(Protocol):
    name: str
    attributes: dict
    start_ns: int
    end_ns: int


def gap_split(spans: Iterable[Span]) -> dict[str, float | int]:
    """The median over the run's gaps of each of ``MILESTONES`` (ms after the optim_step pass ended), and ``gaps``:
    how many gaps had all of them."""
    spans = list(spans)
    passes = sorted((span for span in spans if span.name.startswith("trainer.pass ")), key=lambda span: span.start_ns)
    by_request: dict[str, list[Span]] = {}
    for span in spans:
        request_id = span.attributes.get("lilo.request_id")
        if request_id is not None:
            by_request.setdefault(str(request_id), []).append(span)
    completes = [span for span in spans if span.name == "futures.complete"]
    arrivals = [span for span in spans if span.name == FORWARD_BACKWARD_ROUTE]
    gaps: list[dict[str, float]] = []
    for ended, following in zip(passes, passes[1:]):
        if ended.name != "trainer.pass optim_step" or following.name != "trainer.pass forward_backward":
            continue
        start, end = ended.end_ns, following.start_ns
        written = [span.end_ns for span in completes if start <= span.start_ns < end]
        incoming = [span for span in arrivals if start <= span.start_ns < end]
        if not written or not incoming:
            continue
        theirs = [span for arrival in incoming for span in by_request.get(str(arrival.attributes.get(
            "lilo.request_id")), [])]
        recorded = [span.end_ns for span in theirs if span.name == "futures.record"]
        handed = [span.start_ns for span in theirs if span.name == "trainer.queue_wait"]
        if len(recorded) < len(incoming) or len(handed) < len(incoming):
            continue  # a request whose spans were not all exported
        moments = (max(written), min(span.start_ns for span in incoming), max(span.start_ns for span in incoming),
                   max(recorded), max(handed), end)
        gaps.append({name: (moment - start) / 1e6 for name, moment in zip(MILESTONES, moments)})
    split: dict[str, float | int] = {name: round(statistics.median(gap[name] for gap in gaps), 1) if gaps else 0.0
                                     for name in MILESTONES}
    split["gaps"] = len(gaps)
    return split
