"""What the engine benchmarks share: driving an engine as a trainer does (its compute lane on this, the torch,
thread, a client on another), and random training batches."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from lilo.backend.types import Datum, TrainInput
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


def batch(rng: np.random.Generator, rows: int, seq: int, vocab: int) -> TrainInput:
    """``rows`` random sequences of ``seq`` tokens, each trained to predict its next token."""
    data = []
    for _ in range(rows):
        tokens = rng.integers(0, vocab, seq)
        data.append(Datum(tokens=tokens, loss_inputs={"target_tokens": np.roll(tokens, -1),
                                                      "weights": np.ones(seq, dtype=np.float32)}))
    return TrainInput(data=data)
