"""Where --samplers puts the vLLM sampler actors (cluster.sampling.plane.sampler_layout: pure)."""

from cluster.sampling.plane import SamplerSeat, sampler_layout, samplers_of, trainer_gpu_share

TRAINERS = [("lilo-trainer-0", "a"), ("lilo-trainer-1", "b"), ("lilo-trainer-2", "a")]


def name(index: int) -> str:
    return f"s{index}"


def test_no_samplers_leaves_every_sample_to_the_trainers():
    assert sampler_layout(0, TRAINERS, gpus=True) == []
    assert trainer_gpu_share(0, gpus=True) == 1.0


def test_a_fraction_puts_one_sampler_beside_each_trainer_on_that_share_of_its_gpu():
    seats = sampler_layout(0.25, TRAINERS, gpus=True)
    assert seats == [SamplerSeat(0, "a", 0.25, ("lilo-trainer-0",)), SamplerSeat(1, "b", 0.25, ("lilo-trainer-1",)),
                     SamplerSeat(2, "a", 0.25, ("lilo-trainer-2",))]
    assert trainer_gpu_share(0.25, gpus=True) == 0.75
    assert samplers_of("lilo-trainer-1", seats, name) == ("s1",)


def test_a_count_gives_each_base_model_that_many_samplers_on_a_gpu_each_shared_by_its_trainers():
    seats = sampler_layout(2, TRAINERS, gpus=True)
    assert [(seat.base_model, seat.num_gpus, seat.trainers) for seat in seats] == [
        ("a", 1.0, ("lilo-trainer-0", "lilo-trainer-2")), ("a", 1.0, ("lilo-trainer-0", "lilo-trainer-2")),
        ("b", 1.0, ("lilo-trainer-1",)), ("b", 1.0, ("lilo-trainer-1",))]
    assert [seat.index for seat in seats] == [0, 1, 2, 3]
    assert samplers_of("lilo-trainer-2", seats, name) == ("s0", "s1")
    assert trainer_gpu_share(2, gpus=True) == 1.0


def test_a_sampler_of_a_sharded_base_model_takes_its_ranks_in_gpus_and_splits_the_model_over_them():
    seats = sampler_layout(1, TRAINERS, gpus=True, ranks={"a": 4})
    assert [(seat.base_model, seat.num_gpus, seat.tensor_parallel) for seat in seats] == [("a", 4.0, 4), ("b", 1.0, 1)]
    assert [seat.tensor_parallel for seat in sampler_layout(1, TRAINERS, gpus=False, ranks={"a": 2})] == [2, 1]


def test_a_fraction_beside_a_sharded_trainer_takes_that_share_of_each_of_its_gpus_in_its_group():
    seats = sampler_layout(0.25, TRAINERS, gpus=True, ranks={"a": 2})
    assert [(seat.trainers, seat.num_gpus, seat.tensor_parallel, seat.in_trainer_group) for seat in seats] == [
        (("lilo-trainer-0",), 0.25, 2, True), (("lilo-trainer-1",), 0.25, 1, False),
        (("lilo-trainer-2",), 0.25, 2, True)]
    # On CPU the engine is split the same way, on CPUs of its own: no group to join.
    assert [(seat.tensor_parallel, seat.in_trainer_group) for seat in sampler_layout(
        0.5, TRAINERS, gpus=False, ranks={"a": 2})] == [(2, False), (1, False), (2, False)]
    assert not any(seat.in_trainer_group for seat in sampler_layout(1, TRAINERS, gpus=True, ranks={"a": 2}))


def test_without_gpus_samplers_ask_for_none():
    assert {seat.num_gpus for seat in sampler_layout(0.5, TRAINERS, gpus=False)} == {0.0}
    assert {seat.num_gpus for seat in sampler_layout(1, TRAINERS, gpus=False)} == {0.0}
    assert trainer_gpu_share(0.5, gpus=False) == 0.0
