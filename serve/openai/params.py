"""The request bodies of the OpenAI-compatible routes, checked, and what they ask of a sample.

Fields lilo honours are typed here (so FastAPI checks them and documents them in /openapi.json); any other field is
ignored, unless it would change what the answer means (tools, a response format, penalties...): those are refused
with a 400 that names them (``UNSUPPORTED``), since ignoring them would answer a different question.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from lilo.backend.types import SamplingRequest
from lilo.errors import InvalidRequestError
from lilo.image_assets import NO_ASSETS, ImageAssets
from lilo.protocol.sampling import MAX_NUM_SAMPLES, MAX_TOPK
from serve.http.json_body import INT64_MAX, INT64_MIN
from serve.openai.images import image_part

MAX_MODEL_CHARS = 1024
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat defaults to the rest of the context
MAX_TOKENS = 1 << 31

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = Field(None, description="end the stream with a chunk holding the usage")


class SamplingBody(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS,
                       description="a served base model, or a sampler checkpoint's tinker:// path")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS, description="vLLM's extension; -1: every token")
    n: int | None = Field(None, ge=1, le=MAX_NUM_SAMPLES)
    stop: StopText | list[StopText] | None = Field(None, description=f"up to {MAX_STOPS} strings")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = Field(None, description="text, or a list of text and image_url parts")


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOPK)


class CompletionBody(SamplingBody):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="text or token ids (one prompt: a list of one of either is taken too)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOPK, description="the likeliest tokens to list per token")


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


# Fields that change what the answer means, which lilo cannot honour; present with a neutral value they are taken.
UNSUPPORTED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "tools": ("tool calls", _neutral(None, [])),
    "tool_choice": ("tool calls", _neutral(None, "none")),
    "functions": ("function calls", _neutral(None, [])),
    "function_call": ("function calls", _neutral(None, "none")),
    "response_format": ("structured output", lambda value: value is None or value == {"type": "text"}),
    "logit_bias": ("logit biases", _neutral(None, {})),
    "presence_penalty": ("penalties", _neutral(None, 0, 0.0)),
    "frequency_penalty": ("penalties", _neutral(None, 0, 0.0)),
    "repetition_penalty": ("penalties", _neutral(None, 1, 1.0)),
    "audio": ("audio", _neutral(None)),
    "modalities": ("output other than text", _neutral(None, ["text"])),
    "prediction": ("predicted outputs", _neutral(None)),
    "echo": ("echoing the prompt", _neutral(None, False)),
    "suffix": ("a suffix after the completion", _neutral(None, "")),
}


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a request asks of its sample, checked; the prompt's tokens and the model's facts come later."""

    max_tokens: int | None  # None: the route's default
    temperature: float
    top_p: float
    top_k: int
    n: int
    stop: tuple[str, ...]
    seed: int | None
    top_logprobs: int | None  # None: no logprobs; k: each token's logprob and its k likeliest alternatives
    stream: bool
    include_usage: bool


def asked(body: SamplingBody, max_tokens: int | None, top_logprobs: int | None) -> Asked:
    """The request's sampling settings, or a 400 for a field that changes what it means and that lilo lacks."""
    extras = body.model_extra or {}
    for field, (what, neutral) in UNSUPPORTED.items():
        if field in extras and not neutral(extras[field]):
            raise InvalidRequestError(f"{field} is not supported here: lilo's OpenAI-compatible endpoint does not do "
                                      f"{what}; leave {field} out.")
    best_of = extras.get("best_of")
    if best_of is not None and best_of != (body.n or 1):
        raise InvalidRequestError("best_of is not supported here (lilo returns every sample it draws); leave it out "
                                  "and ask for n samples.")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOPS:
        raise InvalidRequestError(f"stop lists {len(stop)} strings; send at most {MAX_STOPS}.")
    return Asked(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                 top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k in (None, 0) else body.top_k,
                 n=body.n or 1, stop=stop, seed=body.seed, top_logprobs=top_logprobs, stream=bool(body.stream),
                 include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage))


def chat_asked(body: ChatCompletionBody) -> Asked:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true; set it, or leave top_logprobs out.")
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise InvalidRequestError("max_tokens and max_completion_tokens differ; send one of them.")
    return asked(body, body.max_completion_tokens or body.max_tokens,
                 (body.top_logprobs or 0) if body.logprobs else None)


def chat_messages(body: ChatCompletionBody, assets: ImageAssets = NO_ASSETS,
                  ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages as the chat template takes them (each role with its text, text parts joined; a message with
    images as parts, ``{"type": "image"}`` where each goes), and the images' bytes in order (``file://`` URLs read
    through ``assets``)."""
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for number, message in enumerate(body.messages):
        content: Any = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                image = image_part(number, part, assets)
                if image is not None:
                    images.append(image)
                    parts.append({"type": "image"})
                elif part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise InvalidRequestError(f"messages[{number}] holds a content part that is neither text nor "
                                              'an image: send {"type": "text", "text": "..."} or {"type": '
                                              '"image_url", "image_url": {"url": "data:image/jpeg;base64,..."}}.')
            has_image = any(part["type"] == "image" for part in parts)
            content = parts if has_image else "".join(part["text"] for part in parts)
        messages.append({"role": message.role, "content": content or ""})
    return messages, images


def completion_asked(body: CompletionBody) -> Asked:
    return asked(body, body.max_tokens, body.logprobs)


def completion_prompt(body: CompletionBody) -> str | list[int]:
    """The one prompt of the request: text or token ids."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidRequestError(f"prompt holds {len(prompt)} prompts; send one prompt per request.")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequestError("The prompt is empty; send some text or token ids.")
    return prompt


def sampling_request(prompt: Sequence[int], ask: Asked, *, default_max_tokens: int | None, vocab_size: int,
                     max_context_length: int, eos_token_ids: Sequence[int], base_only: bool) -> SamplingRequest:
    """The sample the request asks for, on a base model with these facts. The end-of-sequence token always ends a
    sample (OpenAI's models stop at it too), and so does any of ``stop``. ``default_max_tokens`` None: up to the
    end of the context."""
    if max(prompt) >= vocab_size:
        raise InvalidRequestError(f"The prompt holds token ids outside the vocabulary [0, {vocab_size}); check the "
                                  "tokenizer.")
    room = max_context_length - len(prompt)
    if room < 1:
        raise InvalidRequestError(f"The prompt has {len(prompt)} tokens and the model's context holds "
                                  f"{max_context_length}, so no token fits after it; send a shorter prompt.")
    max_tokens = ask.max_tokens or min(default_max_tokens or room, room)
    if max_tokens > room:
        raise InvalidRequestError(f"max_tokens {max_tokens} does not fit: the prompt has {len(prompt)} tokens and the "
                                  f"model's context holds {max_context_length}; ask for at most {room}.")
    return SamplingRequest(prompt=list(prompt), max_tokens=max_tokens, num_samples=ask.n,
                           temperature=ask.temperature, top_k=ask.top_k, top_p=ask.top_p, seed=ask.seed,
                           stop=[[token] for token in eos_token_ids], stop_strings=ask.stop,
                           topk_sample_logprobs=ask.top_logprobs or 0, base_only=base_only)
