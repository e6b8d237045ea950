"""Sampling from sampler checkpoints and from the bare base model, in the torch backend on a real tiny Llama."""

import copy
import time

import numpy as np
import pytest
import torch

from lilo.backend.checkpoints.paths import INFLIGHT_NAME, parse_tinker_path, sampler_run
from lilo.backend.checkpoints.state import AdapterState, read_peft, write_peft
from lilo.backend.types import AdamParams, Datum, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.backend.torch_backend import TorchBackend
from lilo.engine.commands import Command, Kind
from lilo.errors import InvalidRequestError, NotFoundError, SaturatedError

PROMPT = [5, 17, 99, 3, 250]


@pytest.fixture
def backend(base, tmp_path):
    return TorchBackend(copy.deepcopy(base), max_adapters=3, max_rank=8, checkpoint_dir=tmp_path)


def train(backend: TorchBackend, model_id: str, seed: int) -> None:
    """One real step, so the adapter's output differs from the base model's (a fresh adapter's B is zero)."""
    tokens = np.random.default_rng(seed).integers(0, 1000, 16)
    datum = Datum(tokens=tokens.tolist(), loss_inputs={"target_tokens": np.roll(tokens, -1).tolist(),
                                                       "weights": [1.0] * 16})
    backend.forward_backward([Command(model_id, 1, Kind.FORWARD_BACKWARD, "fb", payload=TrainInput([datum]))], False)
    backend.optim_step([Command(model_id, 2, Kind.OPTIM_STEP, "opt", payload=AdamParams(learning_rate=5e-2))])


def save_for_sampler(backend: TorchBackend, model_id: str, name: str) -> str:
    command = Command(model_id, 3, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name))
    return backend.persist_checkpoint(command, backend.capture_checkpoint(command))["path"]


def greedy(backend: TorchBackend, model_id: str, base_only: bool = False, max_tokens: int = 8):
    request = SamplingRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, base_only=base_only)
    (result,) = backend.sample([Command(model_id, 0, Kind.SAMPLE, "s", payload=request)])
    if isinstance(result, Exception):
        raise result
    return result["sequences"][0]["tokens"]


def test_a_peft_checkpoint_reads_back_as_written(tmp_path):
    spec = LoraSpec(rank=4, alpha=8.0, train_attn=True, train_mlp=False, train_unembed=True)
    tensors = {"model.layers.0.self_attn.q_proj.lora_A": torch.randn(4, 16),
               "model.layers.0.self_attn.q_proj.lora_B": torch.randn(32, 4),
               "lm_head.lora_A": torch.randn(4, 16), "lm_head.lora_B": torch.randn(100, 4)}
    back = read_peft(write_peft(AdapterState(spec, tensors), tmp_path / "ckpt", "lilo/tiny-llama"))
    assert back.spec == spec
    assert back.tensors.keys() == tensors.keys()
    assert all(torch.equal(back.tensors[key], tensors[key]) for key in tensors)


@pytest.mark.parametrize("path, expected", [
    ("tinker://s:train:0/sampler_weights/step-1", ("s:train:0", "sampler_weights", "step-1")),
    ("tinker://run/weights/w", ("run", "weights", "w")),
])
def test_tinker_paths_parse_into_run_kind_and_name(path, expected):
    assert parse_tinker_path(path) == expected


@pytest.mark.parametrize("path, message", [
    ("tinker://run/weights/w", "is not a sampler checkpoint"),
    ("tinker://run/sampler_weights/..", "is not allowed"),
    ("s3://bucket/x", "is not a tinker:// path"),
    ("tinker://run/sampler_weights", "is not of the form"),
])
def test_only_sampler_checkpoint_paths_name_a_run_to_sample(path, message):
    with pytest.raises(InvalidRequestError, match=message):
        sampler_run(path)


def test_a_sampler_checkpoint_samples_as_the_adapter_did_when_it_was_saved(backend):
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    train(backend, "m", seed=1)
    at_save = greedy(backend, "m")
    path = save_for_sampler(backend, "m", "snap")
    train(backend, "m", seed=2)  # training moves on; the snapshot does not
    assert greedy(backend, "m") != at_save
    assert greedy(backend, path) == at_save


def test_an_inflight_checkpoint_saved_again_moves_a_generation_under_way_to_the_new_weights(backend):
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    train(backend, "m", seed=1)
    first = greedy(backend, "m", max_tokens=12)
    path = save_for_sampler(backend, "m", INFLIGHT_NAME)
    train(backend, "m", seed=2)
    second = greedy(backend, "m", max_tokens=12)
    assert second != first
    refresh, tokens_seen = backend._refresh_samplers, []

    def saved_again_after_three_tokens(paths):
        tokens_seen.append(len(tokens_seen) + 1)
        if len(tokens_seen) == 3:  # the model's next inflight save lands while the generation is under way
            time.sleep(0.01)  # a marker of a later mtime than the first save's
            save_for_sampler(backend, "m", INFLIGHT_NAME)
        refresh(paths)

    backend._refresh_samplers = saved_again_after_three_tokens
    tokens = greedy(backend, path, max_tokens=12)
    # The first three tokens came before the new weights did; from the fourth on, the generation runs on them.
    assert tokens[:3] == first[:3] and tokens[3:] != first[3:]
    slot = backend.adapters[path].slot
    assert torch.equal(backend.bank.weights[slot], backend.bank.weights[backend.adapters["m"].slot])
    backend._refresh_samplers = refresh
    assert greedy(backend, path, max_tokens=12) == second  # a new generation samples the new weights from the start


def test_the_bare_base_model_samples_without_any_adapter(backend, base):
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    train(backend, "m", seed=1)
    expected, tokens = [], list(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            expected.append(int(base(input_ids=torch.as_tensor([tokens + expected])).logits[0, -1].argmax()))
    assert greedy(backend, "session:sample:0", base_only=True) == expected
    assert greedy(backend, "m") != expected


def test_sampler_checkpoints_give_their_slots_up_least_recently_used_first(base, tmp_path):
    # No reserved sampler slots: checkpoints live in the training slots while those are free.
    backend = TorchBackend(copy.deepcopy(base), max_adapters=3, max_rank=8, sampler_slots=0, checkpoint_dir=tmp_path)
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    train(backend, "m", seed=1)
    first, second = save_for_sampler(backend, "m", "one"), save_for_sampler(backend, "m", "two")
    greedy(backend, first)
    greedy(backend, second)
    assert backend.free_slots == 2  # cached checkpoints count as free: anyone who needs a slot gets one
    greedy(backend, first)  # now "two" is the least recently used
    backend.add_adapter("n", LoraSpec(rank=4, seed=1))
    assert first in backend.adapters and second not in backend.adapters
    backend.add_adapter("o", LoraSpec(rank=4, seed=2))
    assert first not in backend.adapters
    with pytest.raises(SaturatedError, match="slots of this trainer hold training models"):
        greedy(backend, second)


def test_checkpoints_sample_while_training_models_fill_every_training_slot(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, sampler_slots=2, checkpoint_dir=tmp_path)
    for seed, model_id in enumerate(["m", "n"], start=1):
        backend.add_adapter(model_id, LoraSpec(rank=8, seed=seed))
        train(backend, model_id, seed=seed)
    paths = []
    for step, name in enumerate(["one", "two", "three"]):
        train(backend, "m", seed=10 + step)
        paths.append(save_for_sampler(backend, "m", name))
    alone = [greedy(backend, path) for path in paths]
    assert len({tuple(tokens) for tokens in alone}) == 3  # three different adapters
    # Three checkpoints in one batch, two sampler slots: one waits for a second generation, none fails.
    request = SamplingRequest(prompt=PROMPT, max_tokens=8, temperature=0.0)
    together = backend.sample([Command(path, 0, Kind.SAMPLE, f"s{k}", payload=request)
                               for k, path in enumerate(paths)])
    assert [result["sequences"][0]["tokens"] for result in together] == alone
    # The checkpoints took no training slot: the trainer is still full for training models, and both still train.
    assert backend.free_slots == 0
    with pytest.raises(SaturatedError, match="All 2 adapter slots"):
        backend.add_adapter("o", LoraSpec(rank=4, seed=3))
    assert {"m", "n"} <= backend.adapters.keys()
    train(backend, "n", seed=5)


def test_a_checkpoint_that_does_not_fit_fails_its_sample_and_keeps_no_slot(backend):
    from lilo.backend.checkpoints.paths import local_directory

    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    path = save_for_sampler(backend, "m", "misfit")
    directory = local_directory(backend.checkpoint_dir, path)
    state = read_peft(directory)
    key = next(key for key in state.tensors if key.endswith(".lora_B"))
    state.tensors[key] = state.tensors[key][:-1]  # one row short, as from another base model
    write_peft(state, directory, "another-model")
    with pytest.raises(InvalidRequestError, match="does not fit the base model"):
        greedy(backend, path)
    assert path not in backend.adapters and backend.free_slots == 2
    backend.add_adapter("n", LoraSpec(rank=4, seed=1))
    backend.add_adapter("o", LoraSpec(rank=4, seed=2))
    with pytest.raises(SaturatedError):  # still exactly three training models
        backend.add_adapter("p", LoraSpec(rank=4, seed=3))


def test_a_checkpoint_saved_again_under_its_name_is_reloaded(backend):
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    train(backend, "m", seed=1)
    path = save_for_sampler(backend, "m", "latest")
    before = greedy(backend, path)
    train(backend, "m", seed=2)
    save_for_sampler(backend, "m", "latest")
    assert greedy(backend, path) == greedy(backend, "m") != before


def test_a_missing_checkpoint_fails_its_request_alone(backend):
    good = Command("session:sample:0", 0, Kind.SAMPLE, "a",
                   payload=SamplingRequest(PROMPT, max_tokens=2, base_only=True))
    missing = Command("tinker://m/sampler_weights/nope", 0, Kind.SAMPLE, "b", payload=SamplingRequest(PROMPT))
    results = backend.sample([missing, good])
    assert isinstance(results[0], NotFoundError) and "No sampler checkpoint" in str(results[0])
    assert len(results[1]["sequences"][0]["tokens"]) == 2


def test_an_ephemeral_save_answers_with_its_sampling_session(backend):
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    command = Command("m", 3, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save",
                      payload=SaveRequest("ephemeral-4", sampling_session_id="m:sample:4"))
    assert backend.persist_checkpoint(command, backend.capture_checkpoint(command)) == {
        "path": "tinker://m/sampler_weights/ephemeral-4", "sampling_session_id": "m:sample:4"}
