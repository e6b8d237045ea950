"""Drive an engine the way a trainer does: its compute lane on this (the torch) thread, a client on another."""

from __future__ import annotations

import threading
from typing import Callable

from lilo.engine.engine import Engine


def run_with_compute_lane(engine: Engine, client: Callable[[], None]) -> None:
    """Run ``client`` on a thread of its own while this thread runs ``engine``'s compute lane (started with
    ``start=False``); the engine stops when ``client`` returns or raises."""
    def stopping_after() -> None:
        try:
            client()
        finally:
            engine.stop()

    engine.start(compute_thread=False)
    submitter = threading.Thread(target=stopping_after)
    submitter.start()
    engine.run_compute_lane()
    submitter.join()
