"""Placement is a pure function of the trainers' loads."""

import pytest

from cluster.placement import choose_sampling_trainer, choose_trainer, free_slots
from lilo.backend.paging.policy import Room
from lilo.errors import InvalidRequestError, SaturatedError


@pytest.mark.parametrize(("room", "placed", "expected"), [
    ({"t0": Room(4, 0, 0), "t1": Room(4, 0, 0)}, {}, "t0"),  # a tie: the lowest name
    ({"t0": Room(3, 0, 0), "t1": Room(4, 0, 0)}, {"t0": 1}, "t1"),
    ({"t0": Room(0, 0, 0), "t1": Room(1, 0, 0)}, {"t0": 0, "t1": 9}, "t1"),  # t0 is full
    ({"t1": Room(2, 0, 0), "t0": Room(2, 0, 0)}, {"t0": 1, "t1": 1}, "t0"),
    ({"t0": Room(2, 5, 5), "t1": Room(2, 5, 5)}, {"t0": 3, "t1": 1}, "t1"),  # equal room: the fewest models
    ({"t0": Room(1, 0, 0), "t1": Room(0, 50, 500)}, {}, "t0"),  # a free device slot beats any paging room
    ({"t0": Room(0, 2, 0), "t1": Room(0, 1, 900)}, {}, "t0"),  # then host memory: a copy back, not a file read
    ({"t0": Room(0, 0, 10), "t1": Room(0, 0, 20)}, {"t1": 30}, "t1"),  # then disk, more models or not
    ({"t0": Room(0, 0, 0), "t1": Room(0, 0, 1)}, {"t1": 99}, "t1"),  # room in any tier admits
])
def test_the_trainer_with_the_most_room_gets_the_model(room, placed, expected):
    assert choose_trainer(room, placed) == expected


def test_a_full_cluster_is_a_429_that_says_so():
    with pytest.raises(SaturatedError, match="Every trainer is full .* nor room to page one out"):
        choose_trainer({"t0": Room(0, 0, 0)}, {"t0": 16})


@pytest.mark.parametrize(("room", "after"), [
    (Room(2, 1, 1), Room(1, 1, 1)),  # a new model takes a slot
    (Room(0, 1, 1), Room(0, 0, 1)),  # or pushes an idle one to host memory
    (Room(0, 0, 1), Room(0, 0, 0)),  # or to disk
])
def test_placing_a_model_takes_the_room_of_the_tier_it_lands_in(room, after):
    assert room.less_one() == after


def test_each_trainers_room_is_read_from_what_it_says():
    facts = {"t0": {"base_model": "tiny", "gpu": False, "room": {"device": 1, "host": 2, "disk": 3}},
             "t1": {"base_model": "small", "gpu": False, "room": {"device": 4, "host": 0, "disk": 0}}}
    assert free_slots(facts, "tiny") == {"t0": Room(1, 2, 3)}


def test_once_a_gpu_trainer_serves_the_base_model_new_models_go_to_gpu_trainers_only():
    facts = {"cpu": {"base_model": "tiny", "gpu": False, "room": {"device": 8, "host": 8, "disk": 8}},
             "gpu": {"base_model": "tiny", "gpu": True, "room": {"device": 1, "host": 0, "disk": 0}},
             "other": {"base_model": "small", "gpu": True, "room": {"device": 4, "host": 0, "disk": 0}}}
    assert free_slots(facts, "tiny") == {"gpu": Room(1, 0, 0)}
    # Another base model's GPU trainer does not count: its CPU trainer still takes models.
    del facts["gpu"]
    assert free_slots(facts, "tiny") == {"cpu": Room(8, 8, 8)}


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


def test_a_tenants_new_model_goes_where_it_has_the_fewest_models_among_trainers_with_a_free_slot():
    room = {"t0": Room(3, 0, 0), "t1": Room(1, 0, 0), "t2": Room(0, 8, 0)}
    assert choose_trainer(room, {"t0": 1, "t1": 7}, {"t0": 1}) == "t1"  # spread, though t0 has more room
    assert choose_trainer(room, {"t0": 1, "t1": 7}, {"t0": 1, "t1": 1}) == "t0"  # equal: the most room
    assert choose_trainer(room, {}, {"t0": 2, "t1": 2}) == "t0"  # never to paging while a device slot is free
