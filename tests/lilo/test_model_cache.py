"""The base-model cache: trainers of one node start at once and share it, so a model is made once, race-free."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from lilo.backend.models import load_base_model

STARTS = 4


def start_like_a_trainer(cache: str, together: multiprocessing.Barrier, results: multiprocessing.Queue) -> None:
    from lilo.backend.models import model_directory  # imported before the barrier: the calls start together

    together.wait(timeout=120)
    try:
        results.put(str(model_directory("lilo/tiny-llama", Path(cache))))
    except Exception as error:  # reported, so the test shows what went wrong in the child
        results.put(f"failed: {error!r}")


def test_trainers_starting_together_make_the_cached_model_once_and_all_use_it(tmp_path):
    context = multiprocessing.get_context("spawn")
    together, results = context.Barrier(STARTS), context.Queue()
    starts = [context.Process(target=start_like_a_trainer, args=(str(tmp_path), together, results))
              for _ in range(STARTS)]
    for start in starts:
        start.start()
    answers = [results.get(timeout=300) for _ in starts]
    for start in starts:
        start.join(timeout=60)
    made = Path(answers[0])
    assert made.parent == tmp_path and made.name.startswith("tiny-llama-") and answers == [str(made)] * STARTS
    assert sorted(path.name for path in tmp_path.iterdir()) == [made.name, f"{made.name}.lock"]
    assert load_base_model(made).config.hidden_size == 256
