"""A trainer of two ranks (its frozen base sharded over two gloo processes, its passes packed where the family packs) on
the real local cluster trains, saves and samples exactly as a trainer of one running padded passes: the same
commands, coalesced, give both the same losses, weights and greedy tokens, within fp32 tolerance (the followers'
gradients are summed into rank 0's, so the sum's order differs from one rank's accumulation: about 1e-6 relative
here). The three models page through two slots on both. On a vision-language base (each rank holding the whole
frozen vision tower) rows with images train beside text-only ones and a prompt with an image samples."""

import json

import numpy as np
import pytest
import ray
import torch
from ray.exceptions import ActorAlreadyExistsError

from cluster.trainer.actor import existing_rank_placement_group, remove_rank_placement_group, start_trainer
from cluster.trainer.config import TrainerConfig, trainer_name
from helpers import fresh_actor_index, image_datum, stop_trainer
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_state
from lilo.backend.models import model_directory
from lilo.backend.registry import DEFAULT_BASE_MODEL
from lilo.backend.types import AdamParams, Datum, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.backend.vision import image_layout
from lilo.engine.commands import Command, Kind

SPECS = {"wide": LoraSpec(rank=8, seed=1), "attn": LoraSpec(rank=4, seed=2, train_mlp=False),
         "head": LoraSpec(rank=2, seed=3, train_attn=False, train_unembed=True)}
STEPS = 3
# With eps far above every gradient, Adam's step is the learning rate times the gradient's running mean: the weights
# move by what the gradients were, so comparing the moves compares the gradients (at Tinker's eps of 1e-12 a step is
# about one learning rate in the direction of the gradient's sign, which fp32 rounding decides for a gradient near
# zero: two ranks sum their halves of a batch in another order than one rank does).
ADAM = AdamParams(learning_rate=1.0, eps=100.0)
# Of the largest move (or moment) of each tensor: what fp32 rounding in another reduction order leaves (measured:
# the tiny model's moves within 1e-5 of it, SmolLM2's squared-gradient moments within 2e-4 after three steps through
# its 30 layers); a move is also as coarse as its tensor's rounding (an A of 0.05 moved by 3e-6 is a few ulps).
RTOL = 1e-3
ULP = torch.finfo(torch.float32).eps


def _config(tmp_path_factory, ranks: int) -> TrainerConfig:
    return TrainerConfig(max_adapters=2, max_rank=8, sampler_slots=1, device="cpu", compute_nice=0,
                         host_adapter_mb=64, checkpoint_dir=tmp_path_factory.mktemp(f"checkpoints-{ranks}"),
                         max_batch_tokens=256, pack=ranks > 1)


def _trainers(tmp_path_factory, base_model, ranks):
    config = _config(tmp_path_factory, ranks)
    index = fresh_actor_index()
    return start_trainer(index, base_model, config, num_cpus=1, ranks=ranks), config, trainer_name(index)


# The tiny model, the tiny MoE one (its fused experts sharded with their layers), DeepSeek-V4 (its hash routing
# reads the token ids beside the embeddings), and the demo's real one
# (SmolLM2-135M: 30 layers, tied embeddings, 49k vocabulary),
# and a vision-language one (tiny Qwen3-VL: its deepstack features join the sharded decoder's first layers).
@pytest.fixture(scope="module", params=["lilo/tiny-llama", "lilo/tiny-qwen3-moe", "lilo/tiny-deepseek-v4",
                                        DEFAULT_BASE_MODEL, "lilo/tiny-qwen3-vl"])
def pair(request, ray_driver, tmp_path_factory):
    started = []
    try:
        for ranks in (1, 2):
            started.append(_trainers(tmp_path_factory, request.param, ranks))
        infos = ray.get([actor.ready.remote() for actor, _, _ in started], timeout=300)
        yield [(actor, config, info) for (actor, config, _), info in zip(started, infos)]
    finally:  # also when a start failed
        for actor, _, name in started:
            stop_trainer(actor)
            remove_rank_placement_group(name)  # its CPUs, for the next model's pair


def _datum(rng, length):
    tokens = rng.integers(0, 1000, length)
    return Datum(tokens=tokens, loss_inputs={"target_tokens": np.roll(tokens, -1),
                                             "weights": rng.random(length).astype(np.float32)})


def _save(actor, config, model, seq, name):
    saved = ray.get(actor.run.remote(Command(model, seq, Kind.SAVE_WEIGHTS, f"{model}:{name}",
                                             payload=SaveRequest(name=name))))
    return read_state(local_directory(config.checkpoint_dir, saved["path"])).tensors


def _rows(rng, k: int, step: int, layout) -> list[Datum]:
    """The k-th model's rows of a step: 1 to 3 of text; on a base that takes images, the first model's hold an
    image too (one rank may then run the vision tower while the other runs text alone)."""
    rows = [_datum(rng, n) for n in (7, 19, 3)[:k + 1]]
    return rows + [image_datum(layout, step, size=(40 + 8 * step, 56))] if layout and k == 0 else rows


def _train(actor, config, layout):
    """Every model's steps, each step's forward_backwards sent together (so they coalesce): the losses by step,
    each model's final weights and moments with their moves (less its first), and a greedy sample (of a prompt
    with an image where the base takes images)."""
    for model, spec in SPECS.items():
        ray.get(actor.create_model.remote(model, spec))
    first = {model: _save(actor, config, model, 1, "first") for model in SPECS}
    rng = np.random.default_rng(0)
    losses = []
    for step in range(STEPS):
        passes = [actor.run.remote(Command(model, 2 * step + 2, Kind.FORWARD_BACKWARD, f"{model}:{step}:fb",
                                           payload=TrainInput(data=_rows(rng, k, step, layout)), tokens=64))
                  for k, model in enumerate(SPECS)]
        losses.append([result["metrics"]["loss:sum"] for result in ray.get(passes)])
        ray.get([actor.run.remote(Command(model, 2 * step + 3, Kind.OPTIM_STEP, f"{model}:{step}:opt",
                                          payload=ADAM)) for model in SPECS])
    final = {model: _save(actor, config, model, 2 * STEPS + 2, "final") for model in SPECS}
    moves = {model: {key: (tensor, tensor - first[model].get(key, torch.zeros_like(tensor)))
                     for key, tensor in final[model].items()} for model in SPECS}
    prompt = image_datum(layout, 9, after=1) if layout else Datum(tokens=[1, 2, 3], loss_inputs={})
    greedy = ray.get(actor.run.remote(Command("wide", 2 * STEPS + 3, Kind.SAMPLE, "wide:sample",
                                              payload=SamplingRequest(prompt=list(prompt.tokens),
                                                                      images=prompt.images, max_tokens=8,
                                                                      temperature=0.0))))
    return losses, moves, [s["tokens"] for s in greedy["sequences"]]


def test_two_ranks_train_save_and_sample_as_one(pair):
    (one, one_config, one_info), (two, two_config, two_info) = pair
    assert (one_info["ranks"], two_info["ranks"]) == (1, 2)
    layout = image_layout(model_directory(one_info["base_model"]))
    losses_1, moves_1, greedy_1 = _train(one, one_config, layout)
    losses_2, moves_2, greedy_2 = _train(two, two_config, layout)
    assert np.allclose(losses_2, losses_1, rtol=1e-5), (losses_1, losses_2)
    for model in SPECS:
        assert moves_2[model].keys() == moves_1[model].keys()
        for key, (final, move) in moves_1[model].items():
            tolerance = RTOL * float(move.abs().max()) + 2 * ULP * float(final.abs().max())
            assert float((moves_2[model][key][1] - move).abs().max()) <= tolerance, (model, key)
        assert all(float(move.abs().max()) > 0 for _, move in moves_1[model].values()), model
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
    # Every rank holds the LoRA bank and its gradients; only rank 0, which steps the optimizer, its Adam moments.
    assert ranks[0]["adapter_state_bytes"] == whole["adapter_state_bytes"] == 2 * ranks[1]["adapter_state_bytes"]
    assert ranks[0]["exchanged"]["gathered"] > 0 and ranks[0]["exchanged"]["passes"] > 0


def test_a_start_under_a_running_trainers_name_is_refused_and_a_failed_start_leaves_no_group(
        ray_driver, tmp_path_factory):
    config = _config(tmp_path_factory, ranks=2)
    running_index, failed_index = fresh_actor_index(), fresh_actor_index()
    running = start_trainer(running_index, "lilo/tiny-llama", config, ranks=2)
    name = trainer_name(running_index)
    try:
        group = existing_rank_placement_group(name)
        assert group is not None
        with pytest.raises(ActorAlreadyExistsError, match=f"a trainer named {name} is running"):
            start_trainer(running_index, "lilo/tiny-llama", config, ranks=2)
        # The running trainer's ranks keep their group and so their GPUs (CPUs here).
        assert existing_rank_placement_group(name).id == group.id
        # A start that fails after its group was made (here on a setting Ray refuses) takes the group back.
        with pytest.raises(ValueError, match="cannot be negative"):
            start_trainer(failed_index, "lilo/tiny-llama", config, num_cpus=-1, ranks=2)
        assert existing_rank_placement_group(trainer_name(failed_index)) is None
    finally:
        ray.kill(running)  # it never took a model: nothing to stop
        remove_rank_placement_group(name)
