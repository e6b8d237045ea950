"""Images through the real SDK on vision-language base models (lilo/tiny-qwen3-vl; lilo/tiny-kimi-k2.5, Kimi K2.5 /
K2.6's shape, where the image chunks train and sample too): image chunks train and score
as the cookbook's renderers lay them out (vision start, the image, vision end; targets and weights zero at the
image's positions), two adapters' image rows coalesce, and what lilo cannot take is refused with a sentence:
images on a text-only base model, an expected_tokens that is not the image's count, a file that is not an image.
Images a request points at (image_asset_pointer chunks, OpenAI file:// URLs) are read from the directory the
service allows (--image-dir), and from nowhere else."""

from __future__ import annotations

import io

import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types

from helpers import API_KEY, jpeg, own_service, tiny_vl_with_tokenizer
from lilo.backend.models import model_directory
from lilo.backend.vision import image_layout

VL, KIMI, TEXT = "lilo/tiny-qwen3-vl", "lilo/tiny-kimi-k2.5", "lilo/tiny-llama"
VISION_START, VISION_END = 996, 997
TIMEOUT_S = 180


def image_datum(seed: int, expected_tokens: int | None = None, size: tuple[int, int] = (70, 100),
                data: bytes | None = None, base_model: str = VL) -> types.Datum:
    """Text, vision start, an image, vision end, text; the image's positions neither targeted nor weighted."""
    rng = np.random.default_rng(seed)
    before, after = rng.integers(0, 990, 4).tolist(), rng.integers(0, 990, 5).tolist()
    count = image_layout(model_directory(base_model)).token_count(*size)
    image = types.ImageChunk(data=data or jpeg(*size, seed), format="jpeg",
                             expected_tokens=count if expected_tokens is None else expected_tokens)
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[*before, VISION_START]), image,
                                           types.EncodedTextChunk(tokens=[VISION_END, *after])])
    length = len(before) + 1 + image.expected_tokens + 1 + len(after)
    targets = rng.integers(0, 990, length)
    weights = np.ones(length, dtype=np.float32)
    targets[len(before) + 1:len(before) + 1 + count] = 0
    weights[len(before) + 1:len(before) + 1 + count] = 0.0
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets.tolist(),
                                                                "weights": weights.tolist()})


CHAT_VL = "Qwen/Qwen3-VL-2B-Instruct"  # served from a tiny Qwen3-VL with a tokenizer and chat template


@pytest.fixture(scope="module")
def chat_vl_directory(tmp_path_factory):
    return tiny_vl_with_tokenizer(tmp_path_factory.mktemp("chat-vl") / "model")


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """The directory the service lets requests point at, holding one JPEG (``picture.jpg``, 70 x 100)."""
    directory = tmp_path_factory.mktemp("images")
    (directory / "picture.jpg").write_bytes(jpeg(70, 100, 5))
    return directory


@pytest.fixture(scope="module")
def running(chat_vl_directory, image_dir):
    with own_service("--num-cpus", "6", "--trainers", "1", "--base-model", VL, "--base-model", KIMI,
                     "--base-model", TEXT, "--base-model", f"{CHAT_VL}={chat_vl_directory}",
                     "--image-dir", str(image_dir)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def service(running):
    with tinker.ServiceClient(base_url=running, api_key=API_KEY) as client:
        yield client


@pytest.mark.parametrize("base_model", [VL, KIMI])
def test_image_rows_of_two_adapters_train_and_score(service, base_model):
    client = service
    trainers = [client.create_lora_training_client(base_model=base_model, rank=4, seed=seed).result(
        timeout=TIMEOUT_S) for seed in (1, 2)]
    losses = {0: [], 1: []}
    for _ in range(4):
        # Both adapters' steps sent before either is waited on: they coalesce into one pass.
        futures = [training.forward_backward([image_datum(n, base_model=base_model),
                                              image_datum(n + 10, size=(40, 64), base_model=base_model)],
                                             "cross_entropy")
                   for n, training in enumerate(trainers)]
        for n, future in enumerate(futures):
            losses[n].append(future.result(timeout=TIMEOUT_S).metrics["loss:sum"])
        for training in trainers:
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT_S)
    assert all(steps[-1] < steps[0] for steps in losses.values()), losses
    datum = image_datum(0, base_model=base_model)
    logprobs = trainers[0].forward([datum], "cross_entropy").result(timeout=TIMEOUT_S).loss_fn_outputs[0]["logprobs"]
    assert len(logprobs.tolist()) == datum.model_input.length and np.isfinite(logprobs.tolist()).all()


def refusal(call) -> str:
    with pytest.raises(tinker.APIStatusError) as refused:
        call().result(timeout=TIMEOUT_S)
    assert 400 <= refused.value.status_code < 500
    return str(refused.value)


def test_what_lilo_cannot_take_is_refused_saying_what_to_change(service):
    client = service
    text = client.create_lora_training_client(base_model=TEXT, rank=4).result(timeout=TIMEOUT_S)
    message = refusal(lambda: text.forward_backward([image_datum(1)], "cross_entropy"))
    assert "takes no images" in message and TEXT in message
    vision = client.create_lora_training_client(base_model=VL, rank=4).result(timeout=TIMEOUT_S)
    count = image_layout(model_directory(VL)).token_count(70, 100)
    message = refusal(lambda: vision.forward_backward([image_datum(2, expected_tokens=count + 3)], "cross_entropy"))
    assert f"expected_tokens is {count + 3}, but a 70 x 100 image is {count} tokens" in message
    png_as_jpeg = io.BytesIO()
    Image.new("RGB", (70, 100)).save(png_as_jpeg, "PNG")
    message = refusal(lambda: vision.forward_backward([image_datum(3, data=png_as_jpeg.getvalue())], "cross_entropy"))
    assert "not a JPEG file" in message
    # The refused steps lost nothing: the model trains on.
    result = vision.forward_backward([image_datum(4)], "cross_entropy").result(timeout=TIMEOUT_S)
    assert np.isfinite(result.metrics["loss:sum"])


def laid_out(model_input: types.ModelInput, base_model: str) -> list[int]:
    """The prompt's tokens as the server lays them out: each image as its count of the image token."""
    image_token = image_layout(model_directory(base_model)).image_token_id
    return [token for chunk in model_input.chunks
            for token in (chunk.tokens if isinstance(chunk, types.EncodedTextChunk)
                          else [image_token] * chunk.expected_tokens)]


def scored(training, model_input: types.ModelInput, continuation: list[int], base_model: str = VL) -> list[float]:
    """A training forward's logprob of each token after the first of the prompt and ``continuation``."""
    tokens = laid_out(model_input, base_model) + continuation
    full = model_input.append(types.EncodedTextChunk(tokens=continuation[:-1])) if continuation else model_input
    targets = tokens[1:] + ([] if continuation else [0])
    datum = types.Datum(model_input=full, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})
    return training.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S).loss_fn_outputs[0][
        "logprobs"].tolist()


@pytest.mark.parametrize("base_model", [VL, KIMI])
def test_prompts_with_images_sample_and_score_as_training_does(service, base_model):
    client = service
    training = client.create_lora_training_client(base_model=base_model, rank=4, seed=3).result(timeout=TIMEOUT_S)
    for _ in range(2):
        training.forward_backward([image_datum(7, base_model=base_model)], "cross_entropy").result(timeout=TIMEOUT_S)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT_S)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    prompt = image_datum(8, base_model=base_model).model_input
    chunks = list(prompt.chunks)
    # The docs' own example sends no expected_tokens: the server counts them.
    unsized = types.ModelInput(chunks=[chunks[0], types.ImageChunk(data=chunks[1].data, format="jpeg"), chunks[2]])
    response = sampler.sample(prompt=unsized, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=5, temperature=1.0, seed=2, stop=[])).result(timeout=TIMEOUT_S)
    (sequence,) = response.sequences
    length = prompt.length
    np.testing.assert_allclose(sequence.logprobs, scored(training, prompt, sequence.tokens, base_model)[length - 1:],
                               atol=1e-4)
    prompt_logprobs = sampler.compute_logprobs(prompt).result(timeout=TIMEOUT_S)
    assert len(prompt_logprobs) == length and prompt_logprobs[0] is None
    # Finite at the image's positions too (the cookbook's NLL evaluator sums them, weighted 0), and what training
    # gives them.
    np.testing.assert_allclose(prompt_logprobs[1:], scored(training, prompt, [], base_model)[:length - 1], atol=1e-4)


def test_the_openai_chat_takes_an_image_as_a_data_url(running, chat_vl_directory):
    import base64

    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{running}/oai/api/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg(70, 100, 5)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    reply = client.chat.completions.create(model=CHAT_VL, messages=messages, max_tokens=4, temperature=0.0)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens <= 4
    # The prompt is the chat template's, its one image pad as many as the image is tokens.
    tokenizer = AutoTokenizer.from_pretrained(chat_vl_directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, {"type": "image"}]}], add_generation_prompt=True,
        tokenize=False)
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = image_layout(chat_vl_directory).token_count(70, 100)
    assert reply.usage.prompt_tokens == len(rendered) - 1 + count
    # Greedy is greedy: the same image gives the same answer; another image is another prompt.
    again = client.chat.completions.create(model=CHAT_VL, messages=messages, max_tokens=4, temperature=0.0)
    assert again.choices[0].message.content == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model=TEXT, messages=messages, max_tokens=4)


def test_an_image_asset_pointer_samples_as_its_image_and_points_nowhere_else(service, image_dir, tmp_path):
    sampler = service.create_sampling_client(base_model=VL)
    count = image_layout(model_directory(VL)).token_count(70, 100)
    text_before, text_after = types.EncodedTextChunk(tokens=[5, 6, VISION_START]), types.EncodedTextChunk(
        tokens=[VISION_END, 7])

    def greedy(image) -> list[int]:
        prompt = types.ModelInput(chunks=[text_before, image, text_after])
        return sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=4, temperature=0.0, stop=[])).result(timeout=TIMEOUT_S).sequences[0].tokens

    def pointer(location: str):
        return types.ImageAssetPointerChunk(format="jpeg", location=location, expected_tokens=count)

    sent = greedy(types.ImageChunk(data=(image_dir / "picture.jpg").read_bytes(), format="jpeg"))
    assert greedy(pointer(f"file://{image_dir / 'picture.jpg'}")) == sent
    outside = tmp_path / "elsewhere.jpg"
    outside.write_bytes(jpeg(70, 100, 5))
    (image_dir / "link.jpg").symlink_to(outside)  # a link out of the directory is outside it too
    for location, words in [(f"file://{outside}", "is not under the allowed directories"),
                            (f"file://{image_dir / 'link.jpg'}", "is not under the allowed directories"),
                            ("https://example.com/picture.jpg", "has https scheme; lilo resolves file:// URLs"),
                            (f"file://{image_dir / 'missing.jpg'}", "there is no image file")]:
        assert words in refusal(lambda: sampler.sample(prompt=types.ModelInput(chunks=[
            text_before, pointer(location), text_after]), num_samples=1, sampling_params=types.SamplingParams(
                max_tokens=4)))


def test_the_openai_chat_reads_a_file_url_under_the_allowed_directory(running, image_dir):
    import base64

    import openai

    client = openai.OpenAI(base_url=f"{running}/oai/api/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)

    def chat(url: str):
        return client.chat.completions.create(model=CHAT_VL, max_tokens=4, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])

    data_url = "data:image/jpeg;base64," + base64.b64encode((image_dir / "picture.jpg").read_bytes()).decode()
    assert chat(f"file://{image_dir / 'picture.jpg'}").choices[0].message.content == chat(
        data_url).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="is not under the allowed directories"):
        chat("file:///etc/hostname")
