"""A vLLM sampler actor on the real session cluster, in its own environment (.venv-vllm), against the torch
sampler and the trainer's own logprobs on the same tiny model and the same PEFT adapters, trained here for real."""

import dataclasses
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import ray
import torch

from cluster.sampling.actor import SamplerConfig, sampler_name, start_sampler, vllm_available
from conftest import TINY_DIRECTORY
from helpers import fresh_actor_index
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.types import AdamParams, Datum, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind
from lilo.errors import NotFoundError

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="no vLLM environment: run `make .venv-vllm/.installed` "
                                "(make test does) to test the vLLM sampler")
TIMEOUT_S = 300
# Trained a little on a sequence of their own, so that each steers the base model its own way.
SPECS = {"a": LoraSpec(rank=8, seed=1, train_unembed=False), "b": LoraSpec(rank=4, seed=2, train_unembed=True)}


def tokens_of(name: str) -> list[int]:
    return np.random.default_rng(sum(map(ord, name))).integers(0, 5000, 40).tolist()


@pytest.fixture(scope="module")
def torch_side(ray_driver, tmp_path_factory):
    """The torch backend over the session cluster's tiny model (SmolLM2's vocabulary and tokenizer), with the
    adapters trained and saved for sampling: (backend, {adapter: PEFT directory})."""
    from lilo.backend.models import load_base_model, load_decoder
    from lilo.backend.torch_backend import TorchBackend

    backend = TorchBackend(load_base_model(TINY_DIRECTORY), max_adapters=4, max_rank=32,
                           checkpoint_dir=tmp_path_factory.mktemp("checkpoints"), decode=load_decoder(TINY_DIRECTORY))
    directories = {}
    for model_id, spec in SPECS.items():
        backend.add_adapter(model_id, spec)
        tokens = tokens_of(model_id)
        data = [Datum(tokens=tokens, loss_inputs={"target_tokens": tokens[1:] + [0],
                                                  "weights": [1.0] * (len(tokens) - 1) + [0.0]})]
        for step in range(1, 20, 2):
            backend.forward_backward([Command(model_id, step, Kind.FORWARD_BACKWARD, "fb",
                                              payload=TrainInput(data=data))], forward_only=False)
            backend.optim_step([Command(model_id, step + 1, Kind.OPTIM_STEP, "step",
                                        payload=AdamParams(learning_rate=2e-2))])
        save = Command(model_id, 21, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name="v1"))
        path = backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"]
        directories[model_id] = str(local_directory(backend.checkpoint_dir, path))
    return backend, directories


def published_sampler(directories: dict[str, str], workers: int = 1):
    """A sampler actor of the tiny model (its engine split over ``workers`` tensor-parallel processes) with both
    adapters published under their own names: (actor, what it said it serves); killed after."""
    actor = start_sampler(fresh_actor_index(), str(TINY_DIRECTORY),
                          SamplerConfig(max_loras=4, max_rank=32, device="cpu", kv_cache_gb=1.0,
                                        tensor_parallel_size=workers), num_cpus=workers)
    try:
        info = ray.get(actor.ready.remote(), timeout=TIMEOUT_S)
        for key, directory in directories.items():
            ray.get(actor.publish.remote(key, directory), timeout=TIMEOUT_S)
        yield actor, info
    finally:
        ray.kill(actor)


@pytest.fixture(scope="module")
def sampler(torch_side):
    yield from published_sampler(torch_side[1])


@pytest.fixture(scope="module")
def tensor_parallel_sampler(torch_side):
    """The sampler of a base model that trainers shard over two ranks: its engine's layers split over two workers."""
    yield from published_sampler(torch_side[1], workers=2)


# The checks of what a sample is, run on both samplers.
@pytest.fixture(params=["sampler", "tensor_parallel_sampler"])
def either_sampler(request):
    return request.getfixturevalue(request.param)


def torch_samples(backend, requests: list[SamplingRequest], adapters: list[str | None]) -> list:
    commands = [Command(adapter or "a", 1, Kind.SAMPLE, f"s{i}",
                        payload=dataclasses.replace(request, base_only=adapter is None))
                for i, (request, adapter) in enumerate(zip(requests, adapters))]
    return backend.sample(commands)


def vllm_samples(actor, requests: list[SamplingRequest], adapters: list[str | None]) -> list:
    return ray.get(actor.sample.remote(requests, adapters), timeout=TIMEOUT_S)


def greedy(prompt, **settings) -> SamplingRequest:
    return SamplingRequest(**{"prompt": prompt, "max_tokens": 16, "temperature": 0.0, **settings})


def test_the_sampler_modules_load_neither_torch_nor_vllm():
    """The API replicas import the actor's module for its handle; they have neither torch nor vLLM."""
    script = ("import sys, cluster.sampling.actor, lilo.backend.vllm_sampler\n"
              "print(' '.join(sorted(sys.modules)))\n")
    loaded = set(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
                 .stdout.split())
    assert not loaded & {"torch", "vllm", "transformers"}


@needs_vllm
def test_the_sampler_says_what_it_serves(sampler, torch_side):
    actor, info = sampler
    backend, _ = torch_side
    assert info["engine"] == "vllm" and info["name"].startswith("lilo-sampler-") and info["name"] == sampler_name(
        int(info["name"].rsplit("-", 1)[1]))
    assert info["vocab_size"] == backend.vocab_size
    assert info["eos_token_ids"] == [backend.model.config.eos_token_id]
    assert info["max_loras"] == 4
    assert sorted(ray.get(actor.adapters.remote())) == ["a", "b"]


@needs_vllm
def test_greedy_samples_equal_the_torch_samplers_for_adapter_rows_and_base_rows_batched_with_them(
        either_sampler, torch_side):
    """Rows of both adapters and of the bare base model, each its own concurrent call (they share the engine's
    batches): the same tokens, and the same logprobs and top-k logprobs to 1e-3."""
    actor, _ = either_sampler
    backend, _ = torch_side
    adapters = [None, "a", "b"] * 3
    requests = [greedy(tokens_of("prompt")[:4 + i // 3], topk_sample_logprobs=3) for i in range(len(adapters))]
    expected = torch_samples(backend, requests, adapters)
    got = ray.get([actor.sample.remote([request], [adapter]) for request, adapter in zip(requests, adapters)],
                  timeout=TIMEOUT_S)
    for (ours,), theirs, adapter in zip(got, expected, adapters):
        mine, reference = ours["sequences"][0], theirs["sequences"][0]
        assert mine["tokens"] == reference["tokens"], adapter
        assert mine["stop_reason"] == reference["stop_reason"] == "length"
        assert np.allclose(mine["logprobs"], reference["logprobs"], atol=1e-3)
        for top, reference_top in zip(mine["topk_logprobs"], reference["topk_logprobs"]):
            assert [token for token, _ in top] == [token for token, _ in reference_top]
            assert np.allclose([lp for _, lp in top], [lp for _, lp in reference_top], atol=1e-3)
    # The adapters really steer: on the same prompts, the base model and each adapter sample apart.
    by_row = [[result["sequences"][0]["tokens"] for (result,) in got[i::3]] for i in range(3)]
    assert by_row[0] != by_row[1] and by_row[1] != by_row[2] and by_row[0] != by_row[2]


@needs_vllm
def test_sampled_logprobs_equal_the_trainers_logprobs_of_the_same_tokens(either_sampler, torch_side):
    """The cookbook's check: at temperature 1, a sample's logprobs are those the trainer computes for its tokens."""
    actor, _ = either_sampler
    backend, _ = torch_side
    prompt = tokens_of("a")[:6]
    (result,) = vllm_samples(actor, [SamplingRequest(prompt=prompt, max_tokens=24, seed=3, num_samples=2)], ["a"])
    worst = 0.0
    for sequence in result["sequences"]:
        tokens = prompt + sequence["tokens"]
        datum = Datum(tokens=tokens[:-1],
                      loss_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        (forward,) = backend.forward_backward([Command("a", 1, Kind.FORWARD, "f", payload=TrainInput(data=[datum]))],
                                              forward_only=True)
        trained = forward["loss_fn_outputs"][0]["logprobs"][len(prompt) - 1:]
        worst = max(worst, float(np.max(np.abs(np.asarray(trained) - sequence["logprobs"]))))
    assert worst < 1e-3


@needs_vllm
def test_logprobs_at_another_temperature_are_those_of_the_temperature_scaled_distribution(sampler, torch_side):
    from peft import PeftModel

    from lilo.backend.models import load_base_model

    actor, _ = sampler
    _, directories = torch_side
    prompt = tokens_of("b")[:5]
    (result,) = vllm_samples(actor, [SamplingRequest(prompt=prompt, max_tokens=12, temperature=0.7, seed=11,
                                                     topk_sample_logprobs=2)], ["b"])
    sequence = result["sequences"][0]
    model = PeftModel.from_pretrained(load_base_model(TINY_DIRECTORY), directories["b"]).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor([prompt + sequence["tokens"]])).logits[0, len(prompt) - 1:-1]
    scaled = torch.log_softmax(logits / 0.7, -1)
    expected = scaled.gather(-1, torch.as_tensor(sequence["tokens"]).unsqueeze(-1)).squeeze(-1)
    assert np.allclose(sequence["logprobs"], expected.numpy(), atol=1e-3)
    assert np.allclose([top[0][1] for top in sequence["topk_logprobs"]], scaled.max(-1).values.numpy(), atol=1e-3)


@needs_vllm
def test_a_publish_under_the_same_key_is_used_by_the_very_next_sample(sampler, torch_side, tmp_path):
    """As save_weights_for_sampler does under one name: new files in the same directory, published again."""
    actor, _ = sampler
    _, directories = torch_side
    directory = tmp_path / "sampler_weights" / "latest"
    shutil.copytree(directories["a"], directory)
    key = f"tinker://run-{uuid.uuid4().hex[:6]}/sampler_weights/latest"
    request = greedy(tokens_of("a")[:4])
    by = {adapter: vllm_samples(actor, [request], [adapter])[0]["sequences"][0]["tokens"] for adapter in ("a", "b")}
    assert by["a"] != by["b"]
    assert ray.get(actor.publish.remote(key, str(directory)), timeout=TIMEOUT_S) > 0
    assert vllm_samples(actor, [request], [key])[0]["sequences"][0]["tokens"] == by["a"]
    shutil.rmtree(directory)
    shutil.copytree(directories["b"], directory)
    ray.get(actor.publish.remote(key, str(directory)), timeout=TIMEOUT_S)
    assert vllm_samples(actor, [request], [key])[0]["sequences"][0]["tokens"] == by["b"]
    assert key in ray.get(actor.adapters.remote())


def trainer_logprobs(backend, model_id: str, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The trainer's logprob of each of ``tokens`` after ``prompt`` under adapter ``model_id`` (a forward pass)."""
    sequence = prompt + tokens
    datum = Datum(tokens=sequence[:-1],
                  loss_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)})
    (forward,) = backend.forward_backward([Command(model_id, 1, Kind.FORWARD, "f", payload=TrainInput(data=[datum]))],
                                          forward_only=True)
    return np.asarray(forward["loss_fn_outputs"][0]["logprobs"][len(prompt) - 1:])


@needs_vllm
def test_a_sample_under_way_continues_on_a_version_published_meanwhile(sampler, torch_side, tmp_path):
    """An inflight checkpoint saved again while its samples generate: each continues on the new version from the
    token it had reached, so its first tokens score as adapter a's, the rest as adapter b's."""
    actor, _ = sampler
    backend, directories = torch_side
    directory = tmp_path / "sampler_weights" / "ephemeral-inflight"
    shutil.copytree(directories["a"], directory)
    key = f"tinker://run-{uuid.uuid4().hex[:6]}/sampler_weights/ephemeral-inflight"
    ray.get(actor.publish.remote(key, str(directory)), timeout=TIMEOUT_S)
    prompt = tokens_of("a")[:4]
    # 16 samples of 480 tokens: seconds of generation here (a cancel 2 s into 16 x 400 still finds them running).
    running = actor.sample.remote([SamplingRequest(prompt=prompt, max_tokens=480, seed=5, num_samples=16)], [key])
    time.sleep(1.0)
    shutil.rmtree(directory)
    shutil.copytree(directories["b"], directory)
    ray.get(actor.publish.remote(key, str(directory)), timeout=TIMEOUT_S)
    (result,) = ray.get(running, timeout=TIMEOUT_S)
    splits = []
    for sequence in result["sequences"]:
        got = np.asarray(sequence["logprobs"])
        on_a = np.abs(got - trainer_logprobs(backend, "a", prompt, sequence["tokens"])) < 1e-3
        on_b = np.abs(got - trainer_logprobs(backend, "b", prompt, sequence["tokens"])) < 1e-3
        # The first token not scored as a's: from there on, every token scores as b's.
        split = int(np.argmin(on_a)) if not on_a.all() else len(got)
        assert on_a[:split].all() and on_b[split:].all(), sequence["logprobs"][:8]
        splits.append(split)
    assert any(0 < split < 480 for split in splits), splits  # the new version came in while they generated


@needs_vllm
def test_the_same_seed_gives_the_same_samples(sampler):
    actor, _ = sampler
    request = SamplingRequest(prompt=tokens_of("b")[:3], max_tokens=12, temperature=1.0, seed=7, num_samples=3)
    first, again = (vllm_samples(actor, [request], ["b"])[0] for _ in range(2))
    tokens = [sequence["tokens"] for sequence in first["sequences"]]
    assert tokens == [sequence["tokens"] for sequence in again["sequences"]]
    assert len({tuple(sample) for sample in tokens}) == 3  # each sample draws from its own stream
    other = vllm_samples(actor, [dataclasses.replace(request, seed=8)], ["b"])[0]
    assert [sequence["tokens"] for sequence in other["sequences"]] != tokens


@needs_vllm
def test_seeded_samples_whose_prompts_fill_more_than_one_engine_step(sampler):
    """vLLM 0.32 on CPU died here while it cut prefills into chunks (it rewinds a seeded request's generator for
    the token it discards after a partial prefill, and CPU generators cannot rewind)."""
    actor, _ = sampler
    rng = np.random.default_rng(5)
    requests = [SamplingRequest(prompt=rng.integers(0, 5000, 400).tolist(), max_tokens=4, seed=index, num_samples=2)
                for index in range(12)]  # 9,600 prompt tokens: more than the 4,096 of one step
    results = vllm_samples(actor, requests, ["a", "b", None] * 4)
    assert all(len(sequence["tokens"]) == 4 for result in results for sequence in result["sequences"])


@needs_vllm
def test_stop_tokens_and_stop_strings_end_samples_as_in_the_torch_sampler(sampler, torch_side):
    """The stop is included in the sample, as the torch sampler includes it."""
    from transformers import AutoTokenizer

    actor, _ = sampler
    backend, _ = torch_side
    prompt = tokens_of("a")[:4]
    free = vllm_samples(actor, [greedy(prompt)], ["a"])[0]["sequences"][0]["tokens"]
    text = AutoTokenizer.from_pretrained(TINY_DIRECTORY).decode(free)
    requests = [greedy(prompt, stop=[[free[5]], [free[9]]]), greedy(prompt, stop_strings=[text[len(text) // 2:][:3]])]
    expected = torch_samples(backend, requests, ["a", "a"])
    got = vllm_samples(actor, requests, ["a", "a"])
    for ours, theirs in zip(got, expected):
        assert ours["sequences"][0]["tokens"] == theirs["sequences"][0]["tokens"]
        assert ours["sequences"][0]["stop_reason"] == theirs["sequences"][0]["stop_reason"] == "stop"
        assert len(ours["sequences"][0]["tokens"]) < len(free)


@needs_vllm
def test_a_request_fails_alone_when_its_adapter_is_not_published_or_vllm_cannot_answer_it(sampler):
    actor, _ = sampler
    prompt = tokens_of("a")[:4]
    missing, scored, fine = vllm_samples(actor, [greedy(prompt), greedy(prompt, prompt_logprobs=True), greedy(prompt)],
                                         ["tinker://nobody/sampler_weights/x", "a", None])
    assert isinstance(missing, NotFoundError) and "publish it first" in str(missing)
    assert isinstance(scored, ValueError) and "torch sampler" in str(scored)
    assert len(fine["sequences"][0]["tokens"]) == 16
