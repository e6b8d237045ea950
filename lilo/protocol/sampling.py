"""The JSON ``asample`` request of the Tinker API, decoded and checked at the edge into a ``SamplingRequest``.

Everything the server can tell is wrong before the request runs is refused here, with a sentence saying what to
change (the ingress answers 422), so a bad sample never becomes a stored future.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Mapping, Sequence

from lilo.backend.types import DatumImage, PromptTargets, SamplingRequest, is_int
from lilo.backend.vision import PENDING, ImageLayout
from lilo.errors import InvalidRequestError
from lilo.image_assets import NO_ASSETS, ImageAssets

MAX_NUM_SAMPLES = 128
# Most tokens per position that topk_prompt_logprobs, topk_sample_logprobs and prompt_alt_tokens_k may ask for
# (vLLM's default cap on top-k logprobs).
MAX_TOPK = 20


def decode_sample_request(body: Mapping[str, Any], *, vocab_size: int, max_context_length: int,
                          eos_token_ids: Sequence[int], base_only: bool,
                          images: ImageLayout | None = None, assets: ImageAssets = NO_ASSETS) -> SamplingRequest:
    """``body`` is the SDK's SampleRequest as JSON; the ids, lengths and image layout (None: it takes no images) are
    those of the base model it runs on; ``assets`` resolves its image_asset_pointer chunks."""
    record = body.get("record_stability_info")
    if record is not None and not isinstance(record, bool):
        raise InvalidRequestError(f"record_stability_info must be true or false, not {record!r}.")
    prompt, prompt_images = prompt_tokens(body.get("prompt") or {}, images, assets)
    if not prompt:
        raise InvalidRequestError("The prompt is empty; send at least one token.")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidRequestError(f"The prompt holds token ids outside the vocabulary [0, {vocab_size}); check the "
                                  "tokenizer.")
    num_samples = body.get("num_samples", 1)
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise InvalidRequestError(f"num_samples {num_samples} is out of range; ask for 1 to {MAX_NUM_SAMPLES}.")
    params = body.get("sampling_params") or {}
    prompt_logprobs = bool(body.get("prompt_logprobs"))
    topk_prompt, topk_sample, alt_tokens = (
        topk_count(body, field) for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"))
    targets = prompt_targets(body.get("target_prompt_logprobs"), len(prompt), vocab_size)
    last_n = scored_suffix(body.get("prompt_logprobs_last_n"), prompt_logprobs or topk_prompt > 0, len(prompt))
    scored = SamplingRequest(prompt, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt,
                             target_prompt_logprobs=targets, prompt_alt_tokens_k=alt_tokens).scores_prompt
    room = max_context_length - len(prompt)
    max_tokens = params.get("max_tokens")
    if room == 0 and scored:
        # A prompt that fills the context is scored and nothing sampled (compute_logprobs asks for one token).
        max_tokens = 0
    elif room < 1:
        raise InvalidRequestError(
            f"The prompt has {len(prompt)} tokens and the context holds {max_context_length}, so no token fits "
            f"after it; send a shorter prompt{', or score it with compute_logprobs' if room == 0 else ''}.")
    else:
        max_tokens = room if max_tokens is None else max_tokens  # none given: up to the end of the context
        if not 1 <= max_tokens <= room:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} does not fit: the prompt has {len(prompt)} tokens and the context holds "
                f"{max_context_length}; ask for 1 to {room} tokens, or send a shorter prompt.")
    temperature, top_k, top_p = params.get("temperature", 1.0), params.get("top_k", -1), params.get("top_p", 1.0)
    if temperature < 0 or not 0 < top_p <= 1 or top_k < -1:
        raise InvalidRequestError("temperature must be >= 0, top_p in (0, 1] and top_k -1 (all tokens) or more.")
    stop_tokens, stop_strings = stops(params.get("stop"), eos_token_ids, vocab_size)
    return SamplingRequest(prompt=prompt, max_tokens=max_tokens, num_samples=num_samples, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=params.get("seed"), stop=stop_tokens,
                           stop_strings=stop_strings, prompt_logprobs=prompt_logprobs,
                           prompt_logprobs_last_n=last_n, topk_prompt_logprobs=topk_prompt,
                           topk_sample_logprobs=topk_sample, target_prompt_logprobs=targets,
                           prompt_alt_tokens_k=alt_tokens, base_only=base_only,
                           record_stability_info=bool(record), images=prompt_images)


def topk_count(body: Mapping[str, Any], field: str) -> int:
    value = body.get(field) or 0
    if not is_int(value) or not 0 <= value <= MAX_TOPK:
        raise InvalidRequestError(f"{field} {value!r} is out of range; ask for 0 (none) to {MAX_TOPK} tokens.")
    return int(value)


def prompt_targets(tensor: Any, prompt_length: int, vocab_size: int) -> PromptTargets | None:
    """``target_prompt_logprobs`` (the SDK's TensorData as JSON: dense, or sparse CSR), checked."""
    if tensor is None:
        return None
    expected = f"[len(prompt) - 1, K] = [{prompt_length - 1}, K]"
    if not isinstance(tensor, Mapping):
        raise InvalidRequestError(f"target_prompt_logprobs must be an int64 tensor of token ids, {expected}.")
    shape, values = tensor.get("shape"), tensor.get("data")
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    if tensor.get("dtype") != "int64" or not (isinstance(shape, list) and len(shape) == 2
                                              and all(is_int(n) for n in shape) and shape[0] == prompt_length - 1
                                              and shape[1] >= 0):
        raise InvalidRequestError(f"target_prompt_logprobs must be an int64 tensor of token ids, {expected}; got "
                                  f"dtype {tensor.get('dtype')!r} and shape {shape!r}.")
    if not _int_list(values) or any(not -1 <= value < vocab_size for value in values):
        raise InvalidRequestError(f"target_prompt_logprobs must hold token ids in [0, {vocab_size}), or -1 for "
                                  "none.")
    rows, width = shape
    if crow is None and col is None:
        if len(values) != rows * width:
            raise InvalidRequestError(f"target_prompt_logprobs holds {len(values)} ids; its shape {shape} needs "
                                      f"{rows * width}.")
    elif not (_int_list(crow) and _int_list(col) and len(crow) == rows + 1 and crow[0] == 0
              and crow[-1] == len(values) == len(col) and all(a <= b for a, b in zip(crow, crow[1:]))
              and all(0 <= column < width for column in col)):
        raise InvalidRequestError("target_prompt_logprobs is not a valid sparse CSR tensor: send sparse_crow_indices "
                                  "(rows + 1 pointers from 0 to the value count) and a column in [0, K) per value, "
                                  "both, or neither for a dense tensor.")
    return PromptTargets((rows, width), values, crow, col)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(item) for item in value)


def scored_suffix(last_n: Any, prompt_logprobs: bool, prompt_length: int) -> int | None:
    """``prompt_logprobs_last_n``, checked: how many of the prompt's last tokens to score (None: all)."""
    if last_n is None:
        return None
    if not prompt_logprobs:
        raise InvalidRequestError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs too.")
    if not is_int(last_n) or not 1 <= last_n <= prompt_length - 1:
        raise InvalidRequestError(f"prompt_logprobs_last_n {last_n!r} is out of range: the prompt has {prompt_length} "
                                  f"tokens and the first has no logprob; ask for 1 to {prompt_length - 1}.")
    return int(last_n)


IMAGE_CHUNKS = ("image", "image_asset_pointer")


def has_images(model_input: Mapping[str, Any]) -> bool:
    chunks = model_input.get("chunks") or []
    return isinstance(chunks, list) and any(isinstance(chunk, dict) and chunk.get("type") in IMAGE_CHUNKS
                                            for chunk in chunks)


def prompt_tokens(model_input: Mapping[str, Any], images: ImageLayout | None = None,
                  assets: ImageAssets = NO_ASSETS) -> tuple[list[int], tuple[DatumImage, ...]]:
    """The tokens of a ModelInput (``{"chunks": [...]}``) and its images, each laid out by ``images`` (the base
    model's; None: it takes none); image_asset_pointer chunks read through ``assets``."""
    chunks = model_input.get("chunks") or []
    if not isinstance(chunks, list) or not all(isinstance(chunk, dict) for chunk in chunks):
        raise InvalidRequestError("prompt.chunks must be a list of chunk objects such as "
                                  '{"type": "encoded_text", "tokens": [1, 2]}.')
    tokens: list[int] = []
    pending: list[DatumImage] = []
    for number, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text")
        if kind in IMAGE_CHUNKS:
            pending.append(_image(number, chunk, len(tokens), assets))
            tokens.extend([PENDING] * (pending[-1].tokens or 0))
            continue
        if kind != "encoded_text":
            raise InvalidRequestError(f"Prompt chunk {number}: {kind} chunks are not supported by this server; send "
                                      "text and images.")
        chunk_tokens = chunk.get("tokens") or []
        if not isinstance(chunk_tokens, list) or not all(is_int(token) for token in chunk_tokens):
            raise InvalidRequestError("The prompt's tokens must be a list of integer token ids.")
        tokens.extend(chunk_tokens)
    if not pending:
        return tokens, ()
    if images is None:
        raise InvalidRequestError("This base model takes no images (it has no vision tower); send text only.")
    laid, placed = images.lay_out(tokens, pending, "The prompt")
    return laid, placed


def _image(number: int, chunk: Mapping[str, Any], offset: int, assets: ImageAssets) -> DatumImage:
    """A prompt's image chunk (its bytes base64 in JSON), or a pointer to one that ``assets`` reads."""
    if chunk.get("type") == "image_asset_pointer":
        data = assets.read(chunk.get("location"), f"Prompt chunk {number}")
    else:
        try:
            data = base64.b64decode(chunk.get("data") or "", validate=True)
        except (binascii.Error, TypeError):
            raise InvalidRequestError(f"Prompt chunk {number}: the image's data is not base64; send the file's "
                                      "bytes base64-encoded.") from None
    expected = chunk.get("expected_tokens")
    if expected is not None and (not is_int(expected) or expected < 0):
        raise InvalidRequestError(f"Prompt chunk {number}: expected_tokens must be a whole number of tokens.")
    return DatumImage(data, str(chunk.get("format")), offset, expected)


def stops(stop: str | Sequence[str] | Sequence[int] | None, eos_token_ids: Sequence[int],
          vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """(token stops, string stops) of ``sampling_params.stop``: absent means the end-of-sequence token, ``[]``
    nothing, a list of ids any of those tokens, a string or list of strings that text."""
    if stop is None:
        return [[token] for token in eos_token_ids], []
    if isinstance(stop, str):
        return [], [stop]
    if all(isinstance(item, str) for item in stop):
        return [], list(stop)
    if not all(is_int(item) and 0 <= item < vocab_size for item in stop):
        raise InvalidRequestError(f"stop must be a string, a list of strings, or a list of token ids in "
                                  f"[0, {vocab_size}).")
    return [[token] for token in stop], []
