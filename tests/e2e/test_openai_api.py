"""The OpenAI-compatible endpoint (/oai/api/v1, docs/openai.md) with the real ``openai`` package as its client, on
the session cluster: chat and completions, unstreamed and streamed, from the base model and from a sampler
checkpoint trained through the tinker SDK, answering as the tinker SDK's samples do; and its refusals, as the
``openai`` package's own errors."""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from conftest import TENANT_KEYS
from helpers import unload_models

TIMEOUT_S = 120
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
# A 1 x 1 PNG, as a data URL.
PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/"
           "pLvAAAAAElFTkSuQmCC")
PROMPT = "The sea is"


@pytest.fixture(scope="module")
def chat_model(local_cluster) -> str:
    """The served base model with SmolLM2's tokenizer and chat template (the other, lilo/tiny-llama, has none)."""
    return local_cluster.base_models[1]


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    return AutoTokenizer.from_pretrained(chat_model)


def client_of(local_cluster, api_key: str = "tml-local-test") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{local_cluster.api_url}/oai/api/v1", api_key=api_key, max_retries=0,
                         timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def client(local_cluster) -> openai.OpenAI:
    return client_of(local_cluster)


def streamed_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text, finish reason) of each choice of a stream, and its chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            part = choice.delta.content if chunk.object == "chat.completion.chunk" else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (part or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def sdk_greedy(service, prompt: list[int], max_tokens: int, **where) -> types.SampledSequence:
    sampler = service.create_sampling_client(**where).result(timeout=TIMEOUT_S)
    return sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
                          ).result(timeout=TIMEOUT_S).sequences[0]


def test_the_models_are_the_served_base_models(client, local_cluster):
    assert [model.id for model in client.models.list()] == list(local_cluster.base_models)


def test_a_greedy_chat_streams_the_text_it_answers_unstreamed(client, chat_model, tokenizer):
    answer = client.chat.completions.create(model=chat_model, messages=MESSAGES, temperature=0, max_tokens=12)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == chat_model
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # The tiny random model runs to max_tokens here (its greedy path holds no end-of-sequence token).
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 12
    texts, finish, chunks = streamed_text(client.chat.completions.create(
        model=chat_model, messages=MESSAGES, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: choice.message.content} and finish == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 4  # a chunk per token, not one for the whole text
    assert chunks[-1].choices == [] and chunks[-1].usage == answer.usage


def test_a_completion_of_text_or_of_its_tokens_is_the_tinker_sdks_sample(client, service, chat_model, tokenizer):
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = sdk_greedy(service, prompt, 10, base_model=chat_model)
    of_text = client.completions.create(model=chat_model, prompt=PROMPT, temperature=0, max_tokens=10,
                                        logprobs=2)
    of_tokens = client.completions.create(model=chat_model, prompt=prompt, temperature=0, max_tokens=10)
    assert of_text.object == "text_completion" and of_text.id.startswith("cmpl-")
    assert of_text.choices[0].text == of_tokens.choices[0].text == tokenizer.decode(expected.tokens)
    assert of_text.usage.prompt_tokens == len(prompt) and of_text.usage.completion_tokens == 10
    logprobs = of_text.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert logprobs.tokens == [tokenizer.decode([token]) for token in expected.tokens]
    # Greedy: each token is the likeliest of its alternatives.
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(value, abs=1e-6)
               for top, value in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    texts, finish, _ = streamed_text(client.completions.create(model=chat_model, prompt=PROMPT, temperature=0,
                                                               max_tokens=10, stream=True))
    assert texts == {0: of_text.choices[0].text} and finish == {0: "length"}


def test_chat_logprobs_list_each_token_with_its_likeliest_alternatives(client, chat_model):
    answer = client.chat.completions.create(model=chat_model, messages=MESSAGES, temperature=0, max_tokens=5,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == 5 and "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode())


def test_n_samples_draw_apart_and_a_seed_repeats_them(client, chat_model):
    def draw():
        return client.completions.create(model=chat_model, prompt=PROMPT, n=3, temperature=1.0, seed=11,
                                         max_tokens=8, logprobs=0)

    first = draw()
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert len({choice.text for choice in first.choices}) > 1
    assert [choice.text for choice in draw().choices] == [choice.text for choice in first.choices]
    # Every sampled token counts, the end-of-sequence token that ended a choice too (its text is left out).
    assert first.usage.completion_tokens == sum(len(choice.logprobs.tokens) + (choice.finish_reason == "stop")
                                                for choice in first.choices)
    texts, finish, _ = streamed_text(client.completions.create(model=chat_model, prompt=PROMPT, n=3,
                                                               temperature=1.0, seed=11, max_tokens=8, stream=True))
    assert texts == {choice.index: choice.text for choice in first.choices}
    assert finish == {choice.index: choice.finish_reason for choice in first.choices}


def test_a_stop_string_ends_the_text_before_it(client, chat_model):
    whole = client.completions.create(model=chat_model, prompt=PROMPT, temperature=0, max_tokens=16).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), whole
    cut = whole[:whole.find(stop)]
    answer = client.completions.create(model=chat_model, prompt=PROMPT, temperature=0, max_tokens=16,
                                       stop=[stop, "never-in-the-text"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (cut, "stop")
    texts, finish, _ = streamed_text(client.completions.create(model=chat_model, prompt=PROMPT, temperature=0,
                                                               max_tokens=16, stop=stop, stream=True))
    assert (texts, finish) == ({0: cut}, {0: "stop"})


@pytest.fixture(scope="module")
def checkpoint(local_cluster, chat_model, tokenizer):
    """A sampler checkpoint of the caller's tenant, trained one step through the tinker SDK."""
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        training = service.create_lora_training_client(base_model=chat_model, rank=8).result(timeout=TIMEOUT_S)
        tokens = tokenizer(PROMPT + " deep, blue and full of fish.", add_special_tokens=False)["input_ids"]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        training.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT_S)
        yield training.save_weights_for_sampler("openai-step-1").result(timeout=TIMEOUT_S).path
    unload_models(local_cluster.api_url, [training.model_id])


def test_a_sampler_checkpoint_samples_as_the_tinker_sdk_samples_it(client, service, checkpoint, chat_model,
                                                                   tokenizer):
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = sdk_greedy(service, prompt, 10, model_path=checkpoint)
    base = sdk_greedy(service, prompt, 10, base_model=chat_model)
    assert list(expected.tokens) != list(base.tokens)  # the step changed what the model says
    answer = client.completions.create(model=checkpoint, prompt=prompt, temperature=0, max_tokens=10, logprobs=0)
    assert answer.model == checkpoint
    assert answer.choices[0].text == tokenizer.decode(expected.tokens)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    chat = client.chat.completions.create(model=checkpoint, messages=MESSAGES, temperature=0, max_tokens=6)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6


def test_another_tenants_checkpoint_is_a_model_not_found(local_cluster, checkpoint):
    stranger = client_of(local_cluster, TENANT_KEYS["alpha"])
    with pytest.raises(openai.NotFoundError, match="does not exist") as refused:
        stranger.completions.create(model=checkpoint, prompt="Hi", max_tokens=2)
    assert refused.value.code == "model_not_found"


def test_a_bad_key_is_an_authentication_error(local_cluster, chat_model):
    with pytest.raises(openai.AuthenticationError, match="Unknown API key") as refused:
        client_of(local_cluster, "tml-not-a-key").completions.create(model=chat_model, prompt="Hi", max_tokens=2)
    assert refused.value.code == "invalid_api_key"
    models = f"{local_cluster.api_url}/oai/api/v1/models"
    response = httpx.get(models, timeout=30)
    assert response.status_code == 401 and "Authorization: Bearer" in response.json()["error"]["message"]
    # The tinker SDK's header is taken too.
    assert httpx.get(models, headers={"X-API-Key": "tml-local-test"}, timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_not_found_error_that_names_the_served_ones(client, local_cluster, stream):
    with pytest.raises(openai.NotFoundError, match="lilo/tiny-llama") as refused:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=stream)
    assert refused.value.code == "model_not_found"


@pytest.mark.parametrize(("params", "words"), [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"max_tokens": 100_000}, "does not fit"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/b.png"}}]}]},
     "https URL; lilo reads images from data: URLs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]}]},
     "takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "neither text nor an image"),
])
def test_bad_parameters_are_bad_request_errors_that_say_what_to_change(client, chat_model, params, words):
    request = {"model": chat_model, "messages": MESSAGES, **params}
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(**request)


def test_a_base_model_without_a_tokenizer_is_a_bad_request(client, local_cluster):
    with pytest.raises(openai.BadRequestError, match="ships no tokenizer"):
        client.completions.create(model=local_cluster.base_models[0], prompt="Hi", max_tokens=2)


def test_refusals_are_in_openais_error_shape(local_cluster):
    response = httpx.post(f"{local_cluster.api_url}/oai/api/v1/completions", content=b'{"model": "m", "n": NaN}',
                          headers={"Authorization": "Bearer tml-local-test", "Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not valid JSON" in error["message"]
    assert error["type"] == "invalid_request_error"
