"""How many trainers, and where, is a pure function of the GPU nodes, the trainers known and the clock; whether they
follow the GPUs, of the settings."""

import pytest

from cluster.scaling import (
    GpuNode, Seat, config_has_gpu_workers, may_request_trainer, trainers_to_release, trainers_to_start,
)
from cluster.reconciler import follows_gpus
from lilo.settings import load_settings

MODELS = ("tiny", "small")


def seat(name, model="tiny", node="n1", ready=True, models=0, idle_since=None, gpu=True, ranks=1):
    return Seat(name, model, node, ready, models, idle_since, gpu, ranks)


def test_a_joined_node_gets_one_trainer_per_gpu_with_base_models_dealt_in_turn():
    assert trainers_to_start([GpuNode("n1", 3)], [], MODELS) == [("n1", "tiny"), ("n1", "small"), ("n1", "tiny")]


def test_a_node_with_trainers_for_its_gpus_gets_none_and_the_new_node_gets_the_model_with_fewest():
    seats = [seat("t0", "tiny", "n1")]
    assert trainers_to_start([GpuNode("n1", 1), GpuNode("n2", 1)], seats, MODELS) == [("n2", "small")]


def test_starting_trainers_count_for_their_node():
    seats = [seat("t0", node="n1", ready=False)]
    assert trainers_to_start([GpuNode("n1", 2)], seats, MODELS) == [("n1", "small")]


def test_nothing_starts_while_a_trainer_waits_for_a_node():
    seats = [seat("t0", node=None, ready=False)]
    assert trainers_to_start([GpuNode("n1", 1)], seats, MODELS) == []


def test_gpus_left_free_by_an_idle_release_are_not_filled_again():
    assert trainers_to_start([GpuNode("n1", 2)], [], MODELS, left_free={"n1": 2}) == []
    assert trainers_to_start([GpuNode("n1", 2)], [], MODELS, left_free={"n1": 1}) == [("n1", "tiny")]


def test_a_sharded_base_model_takes_as_many_gpus_as_its_ranks_a_trainer():
    assert trainers_to_start([GpuNode("n1", 8)], [], ("big",), ranks={"big": 4}) == [("n1", "big"), ("n1", "big")]
    # What its groups leave of a node goes to the base models that fit it.
    assert trainers_to_start([GpuNode("n1", 3)], [], ("big", "tiny"), ranks={"big": 2}) == [
        ("n1", "big"), ("n1", "tiny")]
    assert trainers_to_start([GpuNode("n1", 3)], [], ("big",), ranks={"big": 2}) == [("n1", "big")]


def test_a_group_counts_its_gpus_on_its_node_and_gpus_left_free_count_one_each():
    seats = [seat("t0", "big", "n1", ranks=4)]
    assert trainers_to_start([GpuNode("n1", 8)], seats, ("big",), ranks={"big": 4}) == [("n1", "big")]
    assert trainers_to_start([GpuNode("n1", 8)], seats, ("big",), left_free={"n1": 4}, ranks={"big": 4}) == []
    assert trainers_to_start([GpuNode("n1", 4)], [], ("big",), ranks={"big": 8}) == []  # no node holds one


@pytest.mark.parametrize(("seats", "cap", "expected"), [
    ([seat("t0")], 2, True),
    ([seat("t0"), seat("t1", ready=False)], 4, False),  # one of its trainers is on its way
    ([seat("t0"), seat("t1", "small", ready=False)], 4, True),  # another base model's does not count
    ([seat("t0"), seat("t1", "small")], 2, False),  # at the cap
])
def test_one_more_trainer_is_asked_for_a_full_base_model_up_to_the_cap(seats, cap, expected):
    assert may_request_trainer("tiny", seats, cap) is expected


def test_trainers_idle_past_the_timeout_are_released_longest_idle_first():
    seats = [seat("t0", idle_since=50), seat("t1", idle_since=10), seat("t2", models=3)]
    assert trainers_to_release(seats, now=100, idle_timeout_s=30, min_trainers=0) == ["t1", "t0"]


def test_a_trainer_idle_for_less_than_the_timeout_stays():
    assert trainers_to_release([seat("t0", idle_since=80)], now=100, idle_timeout_s=30, min_trainers=0) == []


def test_releases_never_go_below_the_minimum():
    seats = [seat("t0", idle_since=0), seat("t1", idle_since=0), seat("t2", idle_since=0)]
    assert trainers_to_release(seats, now=100, idle_timeout_s=30, min_trainers=2) == ["t0"]
    assert trainers_to_release(seats, now=100, idle_timeout_s=0, min_trainers=0) == []


def test_an_idle_cpu_trainer_is_let_go_once_a_gpu_trainer_serves_its_base_model_whatever_the_minimum():
    seats = [seat("cpu", node="head", idle_since=0, gpu=False), seat("gpu", models=2)]
    assert trainers_to_release(seats, now=100, idle_timeout_s=30, min_trainers=2) == ["cpu"]


@pytest.mark.parametrize("gpu_trainer", [
    seat("gpu", "small", models=1),  # of another base model: the CPU trainer still takes this one's new models
    seat("gpu", ready=False),  # still starting: it serves nothing yet
], ids=["other-base-model", "starting"])
def test_an_idle_cpu_trainer_stays_while_no_ready_gpu_trainer_serves_its_base_model(gpu_trainer):
    seats = [seat("cpu", node="head", idle_since=0, gpu=False), gpu_trainer]
    assert trainers_to_release(seats, now=100, idle_timeout_s=30, min_trainers=0) == []


def test_cpu_trainers_do_not_count_toward_the_minimum_of_gpu_trainers():
    seats = [seat("cpu", node="head", models=1, gpu=False), seat("g0", idle_since=0), seat("g1", idle_since=10)]
    assert trainers_to_release(seats, now=100, idle_timeout_s=30, min_trainers=1) == ["g0"]


def test_a_ray_up_config_with_a_gpu_worker_type_is_a_gpu_cluster():
    config = {"head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 8, "GPU": 0}}, "gpu_worker": {"resources": {"GPU": 4}}}}
    assert config_has_gpu_workers(config)
    config["available_node_types"]["gpu_worker"]["resources"] = {}
    assert not config_has_gpu_workers(config)


@pytest.mark.parametrize(("given", "follows"), [
    ({"ray_address": "10.0.0.1:6379"}, True),  # GPU nodes may join it later, by hand or by the autoscaler
    ({}, False),  # a private head has this machine's GPUs only
    ({"ray_address": "auto", "trainers": 2}, False),
    ({"ray_address": "auto", "samplers": 2}, False),  # samplers of a GPU each: a fixed layout
    ({"ray_address": "auto", "samplers": 0.3}, True),
    ({"ray_address": "auto", "trainer_ranks": "4"}, True),  # groups of four GPUs follow them too
    ({"ray_address": "auto", "follow_gpus": False}, False),
])
def test_trainers_follow_the_gpus_on_an_existing_cluster_unless_the_layout_is_fixed(given, follows):
    assert follows_gpus(load_settings(env={}, **given)) is follows
