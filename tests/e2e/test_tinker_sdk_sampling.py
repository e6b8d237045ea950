"""The official tinker SDK (0.38.0), unchanged, samples from sampler checkpoints, from ephemeral sampler weights
and from the bare base model on the local cluster."""

import numpy as np
import pytest
import tinker
from tinker import types

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120


def memorized_tokens() -> list[int]:
    return np.random.default_rng(3).integers(3, 1000, 16).tolist()


def trained(service) -> tinker.TrainingClient:
    """A LoRA adapter trained a few steps to memorize ``memorized_tokens``."""
    training = service.create_lora_training_client(base_model=TINY, rank=8).result(timeout=TIMEOUT_S)
    tokens = memorized_tokens()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(4):
        training.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
        # 1e-2: five trials each raised the sequence's summed logprob by 48-54 nats; 3e-2 overshot now and then
        # (+20 in one trial of five, -139 in one CI run).
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
    return training


def sample(sampler, prompt=(5, 6, 7), num_samples=2, **params) -> types.SampleResponse:
    params = types.SamplingParams(**{"max_tokens": 6, **params})
    return sampler.sample(prompt=types.ModelInput.from_ints(list(prompt)), num_samples=num_samples,
                          sampling_params=params).result(timeout=TIMEOUT_S)


def tokens_of(response: types.SampleResponse) -> list[list[int]]:
    return [list(sequence.tokens) for sequence in response.sequences]


def test_a_saved_sampler_checkpoint_samples_and_scores_as_the_trained_adapter(service):
    training = trained(service)
    saved = training.save_weights_for_sampler("memorized").result(timeout=TIMEOUT_S)
    # model_path alone: the SDK asks GET samplers/{id} for the base model.
    sampler = service.create_sampling_client(model_path=saved.path).result(timeout=TIMEOUT_S)
    response = sample(sampler, num_samples=3, temperature=0.0, stop=[])
    assert len(response.sequences) == 3 and len({s.sequence_id for s in response.sequences}) == 3
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in response.sequences)
    assert all(len(s.logprobs) == 6 and max(s.logprobs) <= 0 for s in response.sequences)
    # compute_logprobs scores each token given those before it, exactly as the trainer's forward pass does.
    tokens = memorized_tokens()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=TIMEOUT_S)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    forward = training.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    assert scored[0] is None and len(scored) == len(tokens)
    assert scored[1:] == pytest.approx(forward.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4)


def test_save_weights_and_get_sampling_client_samples_a_snapshot(service):
    training = trained(service)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    first = tokens_of(sample(sampler, temperature=1.0, seed=17))
    # Training goes on; the snapshot does not move, and the same seed gives the same tokens.
    training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                           loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3})],
                              "cross_entropy").result(timeout=TIMEOUT_S)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT_S)
    assert tokens_of(sample(sampler, temperature=1.0, seed=17)) == first
    assert first[0] != first[1]  # the samples of one request draw differently


def test_inflight_sampling_clients_all_move_to_the_latest_inflight_save(service):
    training = trained(service)
    older = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT_S)
    scored = types.ModelInput.from_ints(memorized_tokens())
    before = older.compute_logprobs(scored).result(timeout=TIMEOUT_S)
    training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                                           loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3})],
                              "cross_entropy").result(timeout=TIMEOUT_S)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT_S)
    assert older.compute_logprobs(scored).result(timeout=TIMEOUT_S) == before  # nothing published since
    newer = training.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT_S)
    assert newer._sampling_session_id != older._sampling_session_id  # each save: a session (a namespace) of its own
    # The later inflight save updated the one target both sample: the older client scores with the new weights.
    after = older.compute_logprobs(scored).result(timeout=TIMEOUT_S)
    assert after != before and after == newer.compute_logprobs(scored).result(timeout=TIMEOUT_S)


def test_the_bare_base_model_samples_and_scores_unlike_a_trained_adapter(service):
    base = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    response = sample(base, num_samples=2, temperature=0.8, top_k=50, top_p=0.95, seed=5)
    assert all(1 <= len(tokens) <= 6 for tokens in tokens_of(response))
    tokens = types.ModelInput.from_ints(memorized_tokens())
    trained_sampler = trained(service).save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    base_score = sum(base.compute_logprobs(tokens).result(timeout=TIMEOUT_S)[1:])
    trained_score = sum(trained_sampler.compute_logprobs(tokens).result(timeout=TIMEOUT_S)[1:])
    assert trained_score > base_score  # training on the sequence made it likelier; the base model knows nothing of it


def test_compute_logprobs_scores_a_suffix_and_a_prompt_that_fills_the_context(service):
    base = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    tokens = np.random.default_rng(5).integers(3, 1000, 512).tolist()  # the tiny model's whole context
    whole = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=TIMEOUT_S)
    assert len(whole) == 512 and whole[0] is None and all(value <= 0 for value in whole[1:])
    # The SDK's own way to score a completion after a context: only the last N are scored (and checked so by it).
    suffix = base.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=5).result(
        timeout=TIMEOUT_S)
    assert suffix[:-5] == [None] * 507 and suffix[-5:] == pytest.approx(whole[-5:], abs=1e-4)


def test_top_k_logprobs_of_the_prompt_and_of_each_sampled_token(service):
    base = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    response = base.sample(prompt=types.ModelInput.from_ints([5, 6, 7, 8]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
                           include_prompt_logprobs=True, topk_prompt_logprobs=4,
                           topk_sample_logprobs=2).result(timeout=TIMEOUT_S)
    sequence = response.sequences[0]
    assert [top[0][0] for top in sequence.topk_logprobs] == list(sequence.tokens)  # greedy takes the likeliest
    assert all(len(top) == 2 for top in sequence.topk_logprobs)
    assert response.topk_prompt_logprobs[0] is None and all(len(top) == 4 for top in response.topk_prompt_logprobs[1:])
    assert all(logprob <= top[0][1] + 1e-5 for logprob, top in zip(response.prompt_logprobs[1:],
                                                                    response.topk_prompt_logprobs[1:]))


def test_target_prompt_logprobs_and_alternative_prompt_tokens(service):
    base = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    prompt = [5, 6, 7, 8]
    targets = np.array([[6, 9], [7, -1], [8, 3]], dtype=np.int64)  # each prompt token, and one other (or none)
    response = base.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0),
                           include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_numpy(targets),
                           prompt_alt_tokens_k=2).result(timeout=TIMEOUT_S)
    scored = response.target_prompt_logprobs.to_numpy()
    assert scored.shape == (3, 2) and scored[1, 1] == 0.0  # -1 asks for nothing
    assert scored[:, 0].tolist() == pytest.approx(response.prompt_logprobs[1:], abs=1e-5)
    alternatives = response.prompt_alt_tokens
    assert alternatives.tokens.shape == [3, 2] and alternatives.logprobs.shape == [3, 2]
    tokens = alternatives.tokens.to_numpy()
    assert (tokens[:, 0] == tokens[:, 1]).all()  # temperature 0: the likeliest token, twice


def test_a_bad_sampling_request_is_a_4xx_that_says_what_to_change(service):
    base = service.create_sampling_client(base_model=TINY).result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.APIStatusError, match="outside the vocabulary"):
        sample(base, prompt=[5, 5000])
    with pytest.raises(tinker.APIStatusError, match="ask for 1 to"):
        sample(base, max_tokens=10_000)


def test_sampling_what_does_not_exist_is_refused_with_a_message(service):
    with pytest.raises(tinker.APIStatusError, match="No training run"):
        service.create_sampling_client(model_path="tinker://nobody:train:0/sampler_weights/x").result(
            timeout=TIMEOUT_S)
    with pytest.raises(tinker.APIStatusError, match="not a sampler checkpoint"):
        service.create_sampling_client(model_path="tinker://nobody:train:0/weights/x").result(timeout=TIMEOUT_S)
    # A base model this cluster does not serve.
    with pytest.raises(tinker.APIStatusError, match="No trainer serves base model"):
        service.create_sampling_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct").result(timeout=TIMEOUT_S)


def test_a_retried_asample_gets_the_same_future_and_sequence_ids(local_cluster):
    import httpx

    from helpers import AUTH

    api = f"{local_cluster.api_url}/api/v1"
    with httpx.Client(timeout=60, headers=AUTH) as http:
        session_id = http.post(f"{api}/create_session", json={}).json()["session_id"]
        created = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": TINY}
        sampling_session_id = http.post(f"{api}/create_sampling_session", json=created).json()["sampling_session_id"]
        assert http.post(f"{api}/create_sampling_session", json=created).json() == {
            "sampling_session_id": sampling_session_id, "type": "create_sampling_session"}
        assert http.get(f"{api}/samplers/{sampling_session_id}").json() == {
            "sampler_id": sampling_session_id, "base_model": TINY, "model_path": None}
        body = {"sampling_session_id": sampling_session_id, "seq_id": 0, "num_samples": 3,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2, "seed": 1}}
        first, again = (http.post(f"{api}/asample", json=body).json() for _ in range(2))
        assert first == again and len(first["sample_sequence_ids"]) == 3
        clash = http.post(f"{api}/asample", json={**body, "num_samples": 1})
        assert clash.status_code == 409 and "different payload" in clash.json()["detail"]


def test_a_retried_ephemeral_save_gets_the_same_future_though_the_sdk_counted_up(local_cluster):
    # The SDK counts sampling_session_seq_id up on every attempt of save_weights_and_get_sampling_client, so its
    # retry of a request already recorded differs there, and only there.
    import httpx

    from helpers import AUTH, retrieve_finished

    api = f"{local_cluster.api_url}/api/v1"
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service, \
            httpx.Client(timeout=60, headers=AUTH) as http:
        model_id = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S).model_id
        first, retry = (http.post(f"{api}/save_weights_for_sampler", json={
            "model_id": model_id, "seq_id": 1, "sampling_session_seq_id": attempt}) for attempt in (0, 1))
        assert retry.status_code == 200, retry.text
        assert retry.json()["request_id"] == first.json()["request_id"]
        result = retrieve_finished(http, f"{api}/retrieve_future", first.json()["request_id"], polls=2).json()
        assert http.get(f"{api}/samplers/{result['sampling_session_id']}").json()["model_path"] == result["path"]


def test_a_sampler_checkpoint_cannot_take_a_name_the_server_gives_ephemeral_ones(service):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    sampler = training.save_weights_and_get_sampling_client()
    with pytest.raises(tinker.APIStatusError, match="reserved for the checkpoints of save_weights_and_get"):
        training.save_weights_for_sampler("ephemeral-1").result(timeout=TIMEOUT_S)
    # The same name is fine for a training-state checkpoint, and the ephemeral one still samples.
    assert training.save_state("ephemeral-1").result(timeout=TIMEOUT_S).path.endswith("/weights/ephemeral-1")
    assert len(sample(sampler).sequences) == 2
