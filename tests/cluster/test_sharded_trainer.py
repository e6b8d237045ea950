"""A trainer of two ranks (its frozen base sharded over two gloo processes) on the real local cluster trains, saves
and samples exactly as a trainer of one: the same commands, coalesced, give both the same losses, weights and
greedy tokens, within fp32 tolerance (the followers' gradients are summed into rank 0's, so the sum's order
differs from one rank's accumulation: about 1e-6 relative here). The three models page through two slots on both."""

import json
import uuid

import numpy as np
import pytest
import ray

from cluster.trainer_actor import TrainerConfig, start_trainer
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_state
from lilo.backend.types import AdamParams, Datum, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind

SPECS = {"wide": LoraSpec(rank=8, seed=1), "attn": LoraSpec(rank=4, seed=2, train_mlp=False),
         "head": LoraSpec(rank=2, seed=3, train_attn=False, train_unembed=True)}
STEPS = 3


def _trainers(tmp_path_factory, ranks):
    config = TrainerConfig(max_adapters=2, max_rank=8, sampler_slots=1, device="cpu", compute_nice=0,
                           host_adapter_mb=64,
                           checkpoint_dir=tmp_path_factory.mktemp(f"checkpoints-{ranks}"),
                           model_cache_dir=tmp_path_factory.mktemp("models"), max_batch_tokens=256)
    index = 700 + uuid.uuid4().int % 99
    return start_trainer(index, "lilo/tiny-llama", config, num_cpus=1, ranks=ranks), config


@pytest.fixture(scope="module")
def pair(ray_driver, tmp_path_factory):
    started = [_trainers(tmp_path_factory, ranks) for ranks in (1, 2)]
    infos = ray.get([actor.ready.remote() for actor, _ in started], timeout=300)
    yield [(actor, config, info) for (actor, config), info in zip(started, infos)]
    for actor, _ in started:
        ray.get(actor.stop.remote(), timeout=60)
        ray.kill(actor)


def _datum(rng, length):
    tokens = rng.integers(0, 1000, length)
    return Datum(tokens=tokens, loss_inputs={"target_tokens": np.roll(tokens, -1),
                                             "weights": rng.random(length).astype(np.float32)})


def _train(actor, config):
    """Every model's steps, each step's forward_backwards sent together (so they coalesce); the losses by step."""
    for model, spec in SPECS.items():
        ray.get(actor.create_model.remote(model, spec))
    rng = np.random.default_rng(0)
    losses = []
    for step in range(STEPS):
        passes = [actor.run.remote(Command(model, 2 * step + 1, Kind.FORWARD_BACKWARD, f"{model}:{step}:fb",
                                           payload=TrainInput(data=[_datum(rng, n) for n in (7, 19, 3)[:k + 1]]),
                                           tokens=64))
                  for k, model in enumerate(SPECS)]
        losses.append([result["metrics"]["loss:sum"] for result in ray.get(passes)])
        ray.get([actor.run.remote(Command(model, 2 * step + 2, Kind.OPTIM_STEP, f"{model}:{step}:opt",
                                          payload=AdamParams(learning_rate=1e-2))) for model in SPECS])
    saved = {model: ray.get(actor.run.remote(Command(model, 2 * STEPS + 1, Kind.SAVE_WEIGHTS, f"{model}:save",
                                                     payload=SaveRequest(name="final"))))["path"]
             for model in SPECS}
    weights = {model: read_state(local_directory(config.checkpoint_dir, path)).tensors
               for model, path in saved.items()}
    greedy = ray.get(actor.run.remote(Command("wide", 2 * STEPS + 2, Kind.SAMPLE, "wide:sample",
                                              payload=SamplingRequest(prompt=[1, 2, 3], max_tokens=8,
                                                                      temperature=0.0))))
    return losses, weights, [s["tokens"] for s in greedy["sequences"]]


def test_two_ranks_train_save_and_sample_as_one(pair):
    (one, one_config, one_info), (two, two_config, two_info) = pair
    assert (one_info["ranks"], two_info["ranks"]) == (1, 2)
    losses_1, weights_1, greedy_1 = _train(one, one_config)
    losses_2, weights_2, greedy_2 = _train(two, two_config)
    assert np.allclose(losses_2, losses_1, rtol=1e-5), (losses_1, losses_2)
    for model in SPECS:
        assert weights_2[model].keys() == weights_1[model].keys()
        for key, tensor in weights_1[model].items():
            assert float((weights_2[model][key] - tensor).abs().max()) < 1e-5, (model, key)
    assert greedy_2 == greedy_1
    # The three models took turns in two slots on both: paged out to host memory and back in between passes.
    for actor in (one, two):
        assert "page_in" in json.dumps(ray.get(actor.timing.remote()))


def test_the_ranks_say_where_they_run_and_what_each_holds(pair):
    (one, _, _), (two, _, _) = pair
    whole, = ray.get(one.rank_info.remote())
    ranks = ray.get(two.rank_info.remote())
    assert [rank["rank"] for rank in ranks] == [0, 1]
    assert len({rank["pid"] for rank in ranks}) == 2
    # Each rank holds half the decoder layers' weights and the whole embeddings: less than the whole model.
    assert all(rank["base_bytes"] < whole["base_bytes"] for rank in ranks)
    assert ranks[0]["exchanged"]["gathered"] > 0 and ranks[0]["exchanged"]["passes"] > 0
