"""Placement is a pure function of the trainers' loads."""

import pytest

from cluster.placement import choose_sampling_trainer, choose_trainer
from lilo.errors import InvalidRequestError, SaturatedError


@pytest.mark.parametrize(("free", "placed", "expected"), [
    ({"t0": 4, "t1": 4}, {}, "t0"),
    ({"t0": 3, "t1": 4}, {"t0": 1}, "t1"),
    ({"t0": 0, "t1": 1}, {"t0": 0, "t1": 9}, "t1"),
    ({"t1": 2, "t0": 2}, {"t0": 1, "t1": 1}, "t0"),
])
def test_the_least_loaded_trainer_with_room_gets_the_model(free, placed, expected):
    assert choose_trainer(free, placed) == expected


def test_a_full_cluster_is_a_429_that_says_so():
    with pytest.raises(SaturatedError, match="Every trainer is full"):
        choose_trainer({"t0": 0}, {"t0": 16})


SERVED = {"t0": "tiny", "t1": "tiny", "t2": "small"}


@pytest.mark.parametrize(("checkpoint_trainer", "base_model", "expected"), [
    ("t1", "tiny", "t1"),  # the trainer that wrote the checkpoint samples it
    ("t2", "tiny", None),  # it serves another base model: any trainer serving this one
    (None, "small", "t2"),
])
def test_a_sampling_session_goes_to_its_checkpoints_trainer_or_one_serving_its_base_model(
        checkpoint_trainer, base_model, expected):
    chosen = choose_sampling_trainer("s:sample:0", base_model, SERVED, checkpoint_trainer)
    assert chosen == expected if expected else SERVED[chosen] == base_model


def test_sampling_sessions_spread_over_the_trainers_and_each_stays_on_one():
    chosen = [choose_sampling_trainer(f"s:sample:{n}", "tiny", SERVED) for n in range(20)]
    assert set(chosen) == {"t0", "t1"}
    assert chosen == [choose_sampling_trainer(f"s:sample:{n}", "tiny", SERVED) for n in range(20)]


def test_a_base_model_no_trainer_serves_is_refused_with_the_ones_served():
    with pytest.raises(InvalidRequestError, match="No trainer serves base model 'big'; sample from one of small, tiny"):
        choose_sampling_trainer("s:sample:0", "big", SERVED)
