"""The OpenAI-compatible endpoint under /oai/api/v1 (docs/openai.md): ``chat/completions``, ``completions`` and
``models``, behind the same API keys and tenants as the Tinker API.

A request is checked (serve.openai.params), its ``model`` resolved for the caller (serve.openai.sampling), its
prompt tokenized by the trainer that samples it (the API replicas load no tokenizer: transformers' imports torch),
sampled through ``sample_for_openai``, its tokens read back into text a piece per token on that trainer, and the
pieces answered as JSON or streamed as server-sent events (serve.openai.stream).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Callable, Sequence, TypeVar

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, StreamingResponse

from lilo.image_assets import NO_ASSETS, ImageAssets
from lilo.backend.registry import base_model_spec
from lilo.backend.text import CONTEXT_TOKENS
from lilo.backend.types import DatumImage
from lilo.engine.contract import SampledSequence, TopK
from serve.openai.errors import OPENAI_ERROR_RESPONSES, OpenAIRoute
from serve.openai.images import with_images
from serve.openai.keys import OPENAI_PREFIX
from serve.openai.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, Asked, ChatCompletionBody, CompletionBody, chat_asked, chat_messages,
    completion_asked, completion_prompt, sampling_request,
)
from serve.openai.sampling import Target, resolve_model, sample_for_openai
from serve.openai.stream import Choice, Reply, Token, collected, cut_at_stops, sse, whole_generation
from serve.tinker.actors import Actors
from serve.tinker.images import layout_of
from serve.tinker.sampling import SamplingRouter

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
# A 200 is JSON, or server-sent events when the request streams.
ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer, or with stream: true its server-sent events (data: {...} ... data: [DONE]).",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **OPENAI_ERROR_RESPONSES,
}


def openai_route(api: FastAPI, method: str, path: str) -> Callable[[Endpoint], Endpoint]:
    """Registers an ingress method as the OpenAI-compatible route ``/oai/api/v1/<path>``, which answers its errors
    in OpenAI's shape (``OpenAIRoute``)."""
    def register(endpoint: Endpoint) -> Endpoint:
        api.router.add_api_route(OPENAI_PREFIX + path, endpoint, methods=[method], route_class_override=OpenAIRoute,
                                 response_model=None, responses=ANSWERS)
        return endpoint

    return register


def kept_tokens(sequence: SampledSequence, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens whose text is the answer: the end-of-sequence token that ended a sample is left out."""
    tokens = sequence["tokens"]
    if sequence["stop_reason"] == "stop" and tokens and tokens[-1] in eos_token_ids:
        return tokens[:-1]
    return tokens


class OpenAICompatible:
    def __init__(self, actors: Actors, base_models: Sequence[str], assets: ImageAssets = NO_ASSETS) -> None:
        self._actors = actors
        self._assets = assets  # what file:// image URLs may point at
        self._context_lengths = {name: base_model_spec(name).max_context_length for name in base_models}
        self._router = SamplingRouter(actors)

    def models(self) -> dict[str, Any]:
        """The served base models (a sampler checkpoint's tinker:// path is a model too, not listed)."""
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "lilo"}
                                           for name in self._context_lengths]}

    async def chat(self, body: ChatCompletionBody, tenant: str) -> Response:
        ask, (messages, image_data) = chat_asked(body), chat_messages(body, self._assets)
        target = await resolve_model(self._actors, self._router, body.model, self._context_lengths, tenant)
        layout = await layout_of(target.base_model) if image_data else None
        prompt = await self._actors.trainer(target.trainer).render_chat.remote(messages)
        prompt, images = with_images(prompt, image_data, layout)
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model, True, ask.n,
                      ask.top_logprobs is not None)
        return await self._answer(reply, target, prompt, ask, None, images)

    async def completions(self, body: CompletionBody, tenant: str) -> Response:
        ask, prompt = completion_asked(body), completion_prompt(body)
        target = await resolve_model(self._actors, self._router, body.model, self._context_lengths, tenant)
        if isinstance(prompt, str):
            prompt = await self._actors.trainer(target.trainer).encode.remote(prompt)
        reply = Reply(f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model, False, ask.n,
                      ask.top_logprobs is not None)
        return await self._answer(reply, target, prompt, ask, COMPLETIONS_DEFAULT_MAX_TOKENS)

    async def _answer(self, reply: Reply, target: Target, prompt: Sequence[int], ask: Asked,
                      default_max_tokens: int | None, images: tuple[DatumImage, ...] = ()) -> Response:
        request = sampling_request(prompt, ask, default_max_tokens=default_max_tokens, vocab_size=target.vocab_size,
                                   max_context_length=target.max_context_length,
                                   eos_token_ids=target.eos_token_ids, base_only=target.model_path is None)
        request = dataclasses.replace(request, images=images)
        result = await sample_for_openai(self._actors, target.base_model, target.model_path, request,
                                         target.trainer)
        sequences = result["sequences"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(seq["tokens"]) for seq in sequences)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        # The engine answers once the whole generation is done, so the stream replays it a token at a time.
        pieces = cut_at_stops(whole_generation(await self._choices(target, prompt, sequences, ask)), ask.stop)
        if ask.stream:
            return StreamingResponse(sse(reply, pieces, (lambda: usage) if ask.include_usage else None),
                                     media_type="text/event-stream")
        return JSONResponse(await collected(reply, pieces, usage))

    async def _choices(self, target: Target, prompt: Sequence[int], sequences: Sequence[SampledSequence],
                       ask: Asked) -> list[Choice]:
        """Each sample's text a piece per token, and its tokens' logprobs when asked for."""
        trainer = self._actors.trainer(target.trainer)
        kept = [kept_tokens(sequence, target.eos_token_ids) for sequence in sequences]
        pieces = await trainer.detokenize.remote(list(prompt[-CONTEXT_TOKENS:]), kept)
        tokens: list[list[Token] | None] = [None] * len(sequences)
        if ask.top_logprobs is not None:
            tops = [sequence.get("topk_logprobs") or [[]] * len(sequence["tokens"]) for sequence in sequences]
            # Every token's text, the alternatives' too, in one call.
            ids = sorted({token for ids in kept for token in ids} | {alternative for top in tops for alternatives in top
                                                                    for alternative, _ in alternatives})
            texts = dict(zip(ids, await trainer.token_texts.remote(ids)))
            tokens = [logprob_tokens(ids, sequence["logprobs"], top, texts)
                      for ids, sequence, top in zip(kept, sequences, tops)]
        return [Choice(texts_of, tokens_of, sequence["stop_reason"])
                for texts_of, tokens_of, sequence in zip(pieces, tokens, sequences)]


def logprob_tokens(ids: Sequence[int], logprobs: Sequence[float], top: Sequence[TopK],
                   texts: dict[int, str]) -> list[Token]:
    """Each kept token with its logprob and its likeliest alternatives, by their texts."""
    return [Token(texts[token], logprob, tuple((texts[alternative], value) for alternative, value in alternatives))
            for token, logprob, alternatives in zip(ids, logprobs, top)]
