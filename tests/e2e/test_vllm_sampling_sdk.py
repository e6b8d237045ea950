"""The sampling plane's vLLM path through the official tinker SDK: a service started with ``--samplers 1`` relays
the samples vLLM answers exactly to its vLLM sampler actor, and they score as the trainer scores the same tokens
(the cookbook's sampler-vs-trainer check); a sample right after a save reflects that save; the bare base model
samples beside adapters in one engine; what vLLM cannot answer, the torch sampler still does; an abandoned sample is
cancelled on the sampler; inflight clients move to the latest inflight save."""

import time

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from cluster.sampling.actor import vllm_available
from conftest import TINY_DIRECTORY
from helpers import own_service, tokens_datum

TIMEOUT_S = 180
KEY = "tml-vllm-test"
# The cookbook's check (sampler vs trainer logprobs of the same tokens), on CPU in fp32.
LOGPROB_TOLERANCE = 1e-3

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make .venv-vllm/.installed)")


@pytest.fixture(scope="module")
def vllm_service(local_cluster):
    """Its own service (the session cluster has no samplers) on the tiny model with a tokenizer, which the session
    cluster's fixture builds, served as a base model too big for one device would be: its trainer sharded over two
    ranks, its one vLLM sampler tensor parallel over two workers."""
    with own_service("--num-cpus", "6", "--samplers", "1", "--trainer-ranks", "2", "--base-model",
                     str(TINY_DIRECTORY), "--timeout", "400") as (url, printed):
        assert "Sampler lilo-sampler-0 ready" in printed, printed
        assert "tensor parallel over 2" in printed, printed
        with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
            yield client, url


def train(training: tinker.TrainingClient, steps: int, learning_rate: float, seed: int = 3) -> None:
    tokens = np.random.default_rng(seed).integers(3, 1000, 16).tolist()
    for _ in range(steps):
        training.forward_backward([tokens_datum(tokens)], "cross_entropy").result(timeout=TIMEOUT_S)
        training.optim_step(types.AdamParams(learning_rate=learning_rate)).result(timeout=TIMEOUT_S)


def trained_checkpoint(service, name: str, steps: int, learning_rate: float, seed: int = 3):
    """A new adapter trained ``steps`` steps, and its sampler checkpoint ``name``."""
    training = service.create_lora_training_client(base_model=str(TINY_DIRECTORY), rank=8).result(timeout=TIMEOUT_S)
    train(training, steps=steps, learning_rate=learning_rate, seed=seed)
    return training, training.save_weights_for_sampler(name).result(timeout=TIMEOUT_S)


def trainer_logprobs(training: tinker.TrainingClient, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's logprob of each of ``tokens`` after ``prompt`` (a forward pass, as the cookbook checks)."""
    forward = training.forward([tokens_datum(prompt + tokens)], "cross_entropy").result(timeout=TIMEOUT_S)
    return forward.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1:]


def sample(sampler, prompt: list[int], **params) -> types.SampleResponse:
    return sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=params.pop("num_samples", 1),
                          sampling_params=types.SamplingParams(**{"max_tokens": 8, "stop": [], **params}))


def phases(url: str, model_id: str, until=lambda phases: True, within_s: float = 15.0) -> dict:
    """The model's critical path once ``until`` holds of it (trainers push their timing every second or so; until
    the first push, the timing actor knows no such model: a 404)."""
    deadline = time.monotonic() + within_s
    while True:
        response = httpx.get(f"{url}/api/v1/timing", params={"model_id": model_id}, headers={"X-API-Key": KEY})
        late = time.monotonic() > deadline
        if response.status_code != 404 or late:
            response.raise_for_status()
            found = response.json()["phases"]
            if until(found) or late:
                return found
        time.sleep(0.5)


def test_samples_run_on_vllm_and_score_as_the_trainer_scores_them(vllm_service):
    service, url = vllm_service
    training, saved = trained_checkpoint(service, "parity", steps=3, learning_rate=1e-2)
    sampler = service.create_sampling_client(model_path=saved.path).result(timeout=TIMEOUT_S)
    prompt = [5, 6, 7, 8]
    response = sample(sampler, prompt, num_samples=4, temperature=1.0, seed=11).result(timeout=TIMEOUT_S)
    assert len(response.sequences) == 4
    for sequence in response.sequences:
        assert len(sequence.tokens) == 8 and sequence.stop_reason == "length"
        expected = trainer_logprobs(training, prompt, list(sequence.tokens))
        assert sequence.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    again = sample(sampler, prompt, num_samples=4, temperature=1.0, seed=11).result(timeout=TIMEOUT_S)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]  # seeds reproduce
    timing = phases(url, saved.path, until=lambda found: found.get("sample.vllm", {}).get("count", 0) >= 2)
    assert timing["sample.vllm"]["count"] == 2
    assert "sample.execute" not in timing and "sample.publish" not in timing  # nothing to load at sampling time
    # The checkpoint was published to the sampler before its save completed.
    assert phases(url, training.model_id)["save_weights_for_sampler.publish"]["count"] == 1


def test_a_sample_right_after_a_save_under_the_same_name_reflects_that_save(vllm_service):
    service, _ = vllm_service
    training = service.create_lora_training_client(base_model=str(TINY_DIRECTORY), rank=8).result(timeout=TIMEOUT_S)
    prompt = [9, 10, 11]
    before = training.save_weights_for_sampler("moving").result(timeout=TIMEOUT_S)
    sampler = service.create_sampling_client(model_path=before.path).result(timeout=TIMEOUT_S)
    first = sample(sampler, prompt, temperature=0.0).result(timeout=TIMEOUT_S).sequences[0]
    train(training, steps=3, learning_rate=5e-2, seed=4)
    after = training.save_weights_for_sampler("moving").result(timeout=TIMEOUT_S)
    assert after.path == before.path
    second = sample(sampler, prompt, temperature=0.0).result(timeout=TIMEOUT_S).sequences[0]
    assert second.logprobs == pytest.approx(trainer_logprobs(training, prompt, list(second.tokens)),
                                            abs=LOGPROB_TOLERANCE)
    assert (second.tokens, second.logprobs) != (first.tokens, first.logprobs)


def test_the_bare_base_model_samples_beside_an_adapter_in_one_engine(vllm_service):
    service, _ = vllm_service
    fresh = service.create_lora_training_client(base_model=str(TINY_DIRECTORY), rank=8).result(timeout=TIMEOUT_S)
    trained = service.create_lora_training_client(base_model=str(TINY_DIRECTORY), rank=4).result(timeout=TIMEOUT_S)
    train(trained, steps=3, learning_rate=3e-2, seed=5)
    adapter = trained.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    base = service.create_sampling_client(base_model=str(TINY_DIRECTORY)).result(timeout=TIMEOUT_S)
    prompt = [12, 13, 14, 15]
    # In flight together, so the engine may batch the no-adapter row with the adapter's.
    pending = [sample(base, prompt, temperature=0.0), sample(adapter, prompt, temperature=0.0)]
    from_base, from_adapter = (future.result(timeout=TIMEOUT_S).sequences[0] for future in pending)
    # A fresh adapter's B is zero: its forward pass is the bare base model's.
    assert from_base.logprobs == pytest.approx(trainer_logprobs(fresh, prompt, list(from_base.tokens)),
                                               abs=LOGPROB_TOLERANCE)
    assert from_adapter.logprobs == pytest.approx(trainer_logprobs(trained, prompt, list(from_adapter.tokens)),
                                                  abs=LOGPROB_TOLERANCE)


def test_what_vllm_cannot_answer_the_torch_sampler_still_does(vllm_service):
    service, url = vllm_service
    training, saved = trained_checkpoint(service, "scored", steps=2, learning_rate=1e-2)
    sampler = service.create_sampling_client(model_path=saved.path).result(timeout=TIMEOUT_S)
    tokens = [3, 4, 5, 6, 7, 8]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=TIMEOUT_S)
    assert scored[0] is None
    assert scored[1:] == pytest.approx(trainer_logprobs(training, tokens[:1], tokens[1:]), abs=LOGPROB_TOLERANCE)
    # prompt_alt_tokens_k is the torch sampler's alone (the SDK sends it as an extra of the sample request).
    alt = sampler.sample(prompt=types.ModelInput.from_ints(tokens), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=2, temperature=1.0, seed=2),
                         prompt_alt_tokens_k=2).result(timeout=TIMEOUT_S)
    assert alt.sequences and len(alt.sequences[0].tokens) == 2
    assert phases(url, saved.path, until=lambda found: "sample.execute" in found)["sample.execute"]["count"] >= 1


def test_the_openai_endpoint_samples_a_checkpoint_on_vllm_as_the_tinker_sdk_does(vllm_service):
    service, url = vllm_service
    _, saved = trained_checkpoint(service, "openai", steps=2, learning_rate=2e-2, seed=6)
    prompt = [20, 21, 22, 23]
    client = openai.OpenAI(base_url=f"{url}/oai/api/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    completion = client.completions.create(model=saved.path, prompt=prompt, max_tokens=6, temperature=0,
                                           logprobs=0)
    sdk = service.create_sampling_client(model_path=saved.path).result(timeout=TIMEOUT_S)
    expected = sdk.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)
                          ).result(timeout=TIMEOUT_S).sequences[0]
    assert completion.choices[0].logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert completion.usage.completion_tokens == len(expected.tokens)
    found = phases(url, saved.path, until=lambda found: found.get("sample.vllm", {}).get("count", 0) >= 2)
    assert found["sample.vllm"]["count"] == 2 and "sample.execute" not in found


def session_trace(url: str, session_id: str) -> list[dict]:
    """The session's requests as ``tinker session export-trace`` gets them (a signed link to the trace)."""
    # httpx's default 5 s timeout is too short on 2 cores while vLLM generates on them (a CI run timed out once).
    link = httpx.get(f"{url}/api/v1/sessions/{session_id}/trace_export", headers={"X-API-Key": KEY},
                     timeout=60).json()["url"]
    return [event for event in httpx.get(link, timeout=60).json()["traceEvents"] if event["ph"] == "X"]


def test_an_abandoned_vllm_sample_is_cancelled_on_the_sampler(vllm_service):
    service, url = vllm_service
    _, saved = trained_checkpoint(service, "cancelled", steps=1, learning_rate=1e-2)
    sampler = service.create_sampling_client(model_path=saved.path).result(timeout=TIMEOUT_S)
    long = sample(sampler, [5, 6, 7], num_samples=16, max_tokens=400, temperature=1.0)
    time.sleep(2.0)  # relayed to vLLM and generating
    long.future().cancel()  # the SDK sends cancel_future; the relay cancels the sampler's call, vLLM aborts it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        samples = [event for event in session_trace(url, service.holder.get_session_id())
                   if event["name"] == "sample" and event["args"].get("status") != "pending"]
        if any("cancelled by its client" in event["args"].get("error", "") for event in samples):
            break
        time.sleep(1.0)
    else:
        raise AssertionError(f"the abandoned sample was not cancelled: {samples}")
    assert sample(sampler, [5, 6, 7]).result(timeout=TIMEOUT_S).sequences  # the sampler serves on


def test_inflight_clients_on_vllm_sample_the_latest_inflight_save(vllm_service):
    service, _ = vllm_service
    training = service.create_lora_training_client(base_model=str(TINY_DIRECTORY), rank=8).result(timeout=TIMEOUT_S)
    train(training, steps=2, learning_rate=3e-2, seed=6)
    older = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT_S)
    prompt = [21, 22, 23]
    first = sample(older, prompt, temperature=0.0).result(timeout=TIMEOUT_S).sequences[0]
    train(training, steps=3, learning_rate=5e-2, seed=7)
    newer = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT_S)
    moved = sample(older, prompt, temperature=0.0).result(timeout=TIMEOUT_S).sequences[0]
    latest = sample(newer, prompt, temperature=0.0).result(timeout=TIMEOUT_S).sequences[0]
    assert (moved.tokens, moved.logprobs) == (latest.tokens, latest.logprobs)
    assert (moved.tokens, moved.logprobs) != (first.tokens, first.logprobs)
