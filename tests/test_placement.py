"""Placement is a pure function of the trainers' loads."""

import pytest

from cluster.placement import choose_trainer
from lilo.errors import SaturatedError


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
