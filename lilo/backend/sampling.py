"""Batched generation for many adapters at once: every row carries its own adapter slot, sampling settings and
random generator, over one shared KV cache.

Rows are left-padded prompts; each step runs one token per row through the model with per-row adapters (or none:
``BASE_SLOT``), then samples per row: ``temperature`` (0: greedy), ``top_k``, ``top_p``, seeded by ``seed`` and the
sample's index, so the same request gives the same tokens whatever else shares the batch. Reported logprobs are
those of the sampled tokens under the temperature-scaled distribution, and so are the k likeliest tokens of each
sampled position (``topk_sample_logprobs``); ``prompt_logprobs`` those of each prompt token given the ones before
it, and ``topk_prompt_logprobs`` the k likeliest there (None for the first, and for those before the last
``prompt_logprobs_last_n`` when that is set); ``target_prompt_logprobs`` the logprobs of given tokens at each prompt
position after the first, and ``prompt_alt_tokens`` k draws there at the request's temperature (seeded like the
samples). A sample ends at ``max_tokens`` (stop reason ``length``; 0 tokens: the prompt is only scored) or once its
tokens end with a stop token sequence or their text contains a stop string (``stop``, the stop included).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

import numpy as np
import torch

from lilo.backend.families import family_of
from lilo.backend.types import PromptTargets, SamplingRequest
from lilo.backend.vision import ImageLayout, multimodal_inputs
from lilo.engine.contract import AltTokens, SampleResult, TargetLogprobs, TopK
from lilo.errors import InvalidRequestError

STOP, LENGTH = "stop", "length"
CANCELLED = "cancelled"  # a row of a request its client cancelled: never returned (the engine fails the request)
# The random stream of prompt_alt_tokens' draws: apart from every sample's (sample k draws from stream k).
ALT_TOKENS_STREAM = -1


@dataclasses.dataclass
class Row:
    request: int  # index of the request this row samples for
    slot: int
    settings: SamplingRequest
    generator: torch.Generator
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    topk: list[TopK] = dataclasses.field(default_factory=list)  # per sampled token, when asked for
    stop_reason: str | None = None


Decode = Callable[[Sequence[int]], str]


def validate(request: SamplingRequest, vocab_size: int, decode: Decode | None) -> None:
    if not request.prompt:
        raise InvalidRequestError("The prompt is empty; send at least one token.")
    if min(request.prompt) < 0 or max(request.prompt) >= vocab_size:
        raise InvalidRequestError(f"The prompt holds ids outside the vocabulary [0, {vocab_size}).")
    if request.max_tokens < (0 if request.scores_prompt else 1) or request.num_samples < 1:
        raise InvalidRequestError("max_tokens and num_samples must be at least 1 (max_tokens may be 0 when the "
                                  "prompt's logprobs are asked for).")
    if request.temperature < 0 or not 0 < request.top_p <= 1:
        raise InvalidRequestError("temperature must be >= 0 and top_p in (0, 1].")
    if request.stop_strings and decode is None:
        raise InvalidRequestError("This base model has no tokenizer to match stop strings; send stop token ids.")


def scores_whole_prompt(request: SamplingRequest) -> bool:
    """Whether the request needs logits at every prompt position (``prompt_logprobs_last_n`` narrows only the
    prompt's logprobs and top-k)."""
    return (request.prompt_logprobs_last_n is None and request.scores_prompt) or request.prompt_alt_tokens_k > 0 \
        or request.target_prompt_logprobs is not None


def sample_next(logits: torch.Tensor, settings: SamplingRequest,
                generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """One token for one row from its last-position logits, and the logprobs of every token it was drawn by."""
    if settings.temperature == 0:
        return int(torch.argmax(logits)), torch.log_softmax(logits, -1)
    scaled = logits / settings.temperature
    logprobs = torch.log_softmax(scaled, -1)
    filtered = scaled.clone()
    if 0 < settings.top_k < filtered.numel():
        kth = torch.topk(filtered, settings.top_k).values[-1]
        filtered[filtered < kth] = float("-inf")
    if settings.top_p < 1.0:
        ordered, order = torch.sort(filtered, descending=True)
        cumulative = torch.cumsum(torch.softmax(ordered, -1), -1)
        drop = cumulative - torch.softmax(ordered, -1) > settings.top_p  # keep the smallest prefix reaching top_p
        filtered[order[drop]] = float("-inf")
    token = int(torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator))
    return token, logprobs


def sample_step(logits: torch.Tensor, rows: Sequence[Row]) -> tuple[list[int], torch.Tensor]:
    """One token for each of ``rows`` from its last-position logits (a row each), and the logprobs of every token
    it was drawn by: ``sample_next``'s answers, bit for bit, with a few batched ops instead of a few per row. A draw
    is torch.multinomial's own for one sample (the argmax of p / q, q ~ Exp(1) from the row's generator), so a seed
    gives the same tokens as before; rows with top-k or top-p go through ``sample_next``."""
    temperatures = [row.settings.temperature for row in rows]
    if len(set(temperatures)) == 1:  # the usual batch: one op
        scaled = logits / temperatures[0] if temperatures[0] else logits
    else:
        scaled = torch.empty_like(logits)
        for temperature in set(temperatures):
            members = [n for n, t in enumerate(temperatures) if t == temperature]
            scaled[members] = logits[members] / temperature if temperature else logits[members]
    logprobs = torch.log_softmax(scaled, -1)
    tokens = scaled.argmax(-1).tolist()  # the greedy rows' (temperature 0: scaled is logits)
    filtered = [n for n, row in enumerate(rows) if row.settings.temperature and _filters(row.settings, logits)]
    drawn = [n for n, row in enumerate(rows) if row.settings.temperature and n not in filtered]
    if drawn:
        probs = torch.softmax(scaled[drawn], -1)
        noise = torch.empty_like(probs)
        for k, n in enumerate(drawn):
            noise[k].exponential_(1, generator=rows[n].generator)
        for n, token in zip(drawn, (probs / noise).argmax(-1).tolist()):
            tokens[n] = token
    for n in filtered:
        tokens[n] = sample_next(logits[n], rows[n].settings, rows[n].generator)[0]
    return tokens, logprobs


def _filters(settings: SamplingRequest, logits: torch.Tensor) -> bool:
    """Whether top-k or top-p leaves out some of the vocabulary."""
    return 0 < settings.top_k < logits.shape[-1] or settings.top_p < 1.0


def generate(model: torch.nn.Module, route: Callable[[Sequence[int] | None], None],
             requests: Sequence[SamplingRequest], slots: Sequence[int],
             decode: Decode | None = None, images: ImageLayout | None = None,
             cancelled: Callable[[int], bool] | None = None,
             between_tokens: Callable[[], None] | None = None) -> list[SampleResult]:
    """Sample every request (request i through adapter slot ``slots[i]``) in one batched generation, or one per
    prompt length for a family whose cache cannot take left-padded prompts. A request ``cancelled(i)`` says is
    cancelled stops at its next token (its result is then of no use to anyone). ``between_tokens`` runs before
    each token after the first (a slot's weights may change there: an inflight checkpoint saved again)."""
    lengths = {len(request.prompt) for request in requests}
    if len(lengths) > 1 and not family_of(getattr(model.config, "model_type", "")).left_padding:
        results: list[SampleResult | None] = [None] * len(requests)
        for length in lengths:
            indices = [i for i, request in enumerate(requests) if len(request.prompt) == length]
            of_group = None if cancelled is None else lambda j, indices=indices: cancelled(indices[j])
            generated = generate(model, route, [requests[i] for i in indices], [slots[i] for i in indices], decode,
                                 images, of_group, between_tokens)
            for i, result in zip(indices, generated):
                results[i] = result
        return results  # type: ignore[return-value]
    device = next(model.parameters()).device
    rows = [Row(i, slots[i], request, _generator(request.seed, k), stop_reason=None if request.max_tokens else LENGTH)
            for i, request in enumerate(requests) for k in range(request.num_samples)]
    # Each adapter's rows side by side, so the LoRA layers run one GEMM per adapter, not per row (a stable sort: a
    # request's samples keep their order, and results go back by request).
    rows.sort(key=lambda row: row.slot)
    width = max(len(request.prompt) for request in requests)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        prompt = torch.as_tensor(list(row.settings.prompt))
        ids[r, width - len(prompt):] = prompt
        mask[r, width - len(prompt):] = 1
    prompt_scores: dict[int, dict[str, Any]] = {}
    ids, mask = ids.to(device), mask.to(device)
    route([row.slot for row in rows])
    try:
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            # The prefill's logits at every position (rows x width x vocabulary: gigabytes for a long prompt and
            # many samples) only as far back as some row's prompt logprobs need them; else the last position's.
            keep = logits_to_keep(requests)
            prompt_images = [image for row in rows for image in row.settings.images]
            if prompt_images and images is not None:
                inputs = multimodal_inputs(model.model, images, ids, mask, prompt_images, positions=positions)
                out = model(**inputs, attention_mask=mask, use_cache=True, logits_to_keep=keep)
                if inputs["position_ids"].dim() == 3:
                    # Multimodal rotary positions (3 axes): each row's next token one past its furthest position.
                    positions = inputs["position_ids"].amax(dim=(0, 2)).view(1, -1, 1).expand(3, -1, 1)
                else:
                    positions = positions[:, -1:]
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=keep)
                positions = positions[:, -1:]
            for r, row in enumerate(rows):
                if row.settings.scores_prompt and row.request not in prompt_scores:
                    prompt_scores[row.request] = _prompt_scores(out.logits[r].cpu(), ids[r].cpu(), row.settings)
            logits, cache = out.logits[:, -1].float().cpu(), out.cache
            for _ in range(max(request.max_tokens for request in requests)):
                if cancelled is not None:
                    for row in rows:
                        if row.stop_reason is None and cancelled(row.request):
                            row.stop_reason = CANCELLED
                    if all(row.stop_reason is not None for row in rows):
                        break
                next_ids = torch.zeros(len(rows), 1, dtype=torch.long)
                active = [r for r, row in enumerate(rows) if row.stop_reason is None]
                tokens, logprobs = sample_step(logits if len(active) == len(rows) else logits[active],
                                               [rows[r] for r in active])
                chosen = logprobs.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
                for n, (r, token) in enumerate(zip(active, tokens)):
                    row = rows[r]
                    row.tokens.append(token)
                    row.logprobs.append(chosen[n])
                    if row.settings.topk_sample_logprobs:
                        row.topk.extend(_topk(logprobs[n:n + 1], row.settings.topk_sample_logprobs))
                    row.stop_reason = _stopped(row, decode)
                    next_ids[r, 0] = token
                if all(row.stop_reason is not None for row in rows):
                    break
                if between_tokens is not None:
                    between_tokens()
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long, device=device)], dim=1)
                positions = positions + 1
                out = model(input_ids=next_ids.to(device), attention_mask=mask, position_ids=positions,
                            cache=cache, use_cache=True)
                logits, cache = out.logits[:, -1].float().cpu(), out.cache
    finally:
        route(None)
    results: list[SampleResult] = [{"sequences": []} for _ in requests]
    for row in rows:
        sequence = {"tokens": row.tokens, "logprobs": row.logprobs, "stop_reason": row.stop_reason or LENGTH}
        if row.settings.topk_sample_logprobs:
            sequence["topk_logprobs"] = row.topk
        results[row.request]["sequences"].append(sequence)
    for index, scores in prompt_scores.items():
        results[index].update(scores)
    return results


def _generator(seed: int | None, sample_index: int) -> torch.Generator:
    """Sample k of a request draws from its own stream: the same seed gives the same tokens in any batch."""
    base = seed if seed is not None else random.getrandbits(62)
    return torch.Generator().manual_seed((base * 1_000_003 + sample_index) % 2**63)


def _stopped(row: Row, decode: Decode | None) -> str | None:
    for stop in row.settings.stop:
        if stop and row.tokens[-len(stop):] == list(stop):
            return STOP
    if row.settings.stop_strings and decode is not None:
        text = decode(row.tokens)
        if any(stop and stop in text for stop in row.settings.stop_strings):
            return STOP
    return LENGTH if len(row.tokens) >= row.settings.max_tokens else None


def logits_to_keep(requests: Sequence[SamplingRequest]) -> int:
    """How many of the prefill's last positions need logits (0: all): 1 to sample from, N + 1 to score a prompt's
    last N tokens (a token is scored by the logits of the position before it)."""
    keep = 1
    for request in requests:
        if scores_whole_prompt(request):
            return 0
        if request.scores_prompt:
            keep = max(keep, request.prompt_logprobs_last_n + 1)
    return keep


def _prompt_scores(logits: torch.Tensor, ids: torch.Tensor, request: SamplingRequest) -> dict[str, Any]:
    """``prompt_logprobs`` (each scored prompt token's logprob given those before it) and ``topk_prompt_logprobs``
    (the k likeliest tokens there), as asked; None for the positions not scored (the first, and those before
    ``prompt_logprobs_last_n``). ``logits`` are the row's last positions', the row left-padded to ``ids``' width."""
    length = len(request.prompt)
    scored = length - 1 if request.prompt_logprobs_last_n is None else request.prompt_logprobs_last_n
    kept = logits.shape[0]

    def last_positions(count: int) -> torch.Tensor:
        """Logprobs of the next token at the ``count`` positions before the last (scoring the last ``count``
        prompt tokens)."""
        return torch.log_softmax(logits[kept - 1 - count:kept - 1].float(), -1)

    logprobs = last_positions(scored)
    unscored: list = [None] * (length - scored)
    scores: dict[str, Any] = {}
    if request.prompt_logprobs:
        targets = ids[ids.numel() - scored:].unsqueeze(-1)
        scores["prompt_logprobs"] = unscored + logprobs.gather(-1, targets).squeeze(-1).tolist()
    if request.topk_prompt_logprobs:
        scores["topk_prompt_logprobs"] = unscored + _topk(logprobs, request.topk_prompt_logprobs)
    if request.target_prompt_logprobs is not None or request.prompt_alt_tokens_k:
        everywhere = logprobs if scored == length - 1 else last_positions(length - 1)
        if request.target_prompt_logprobs is not None:
            scores["target_prompt_logprobs"] = _target_logprobs(everywhere, request.target_prompt_logprobs)
        if request.prompt_alt_tokens_k:
            scores["prompt_alt_tokens"] = _alt_tokens(everywhere, request)
    return scores


def _target_logprobs(logprobs: torch.Tensor, targets: PromptTargets) -> TargetLogprobs:
    """The logprobs of ``targets``' tokens (0.0 where -1), in its layout, from the prompt positions' logprobs."""
    ids = torch.as_tensor(np.asarray(targets.values, dtype=np.int64))
    values = logprobs[torch.as_tensor(targets.value_rows()), ids.clamp(min=0)].masked_fill(ids < 0, 0.0)
    return {"shape": list(targets.shape), "values": values.tolist(), "crow_indices": targets.crow_indices,
            "col_indices": targets.col_indices}


def _alt_tokens(logprobs: torch.Tensor, request: SamplingRequest) -> AltTokens:
    """``prompt_alt_tokens_k`` draws with replacement from each prompt position's next-token distribution at the
    request's temperature (0: the likeliest token, k times), with their logprobs under it."""
    k = request.prompt_alt_tokens_k
    if request.temperature == 0:
        tokens = logprobs.argmax(-1, keepdim=True).expand(-1, k)
        scaled = logprobs
    else:
        scaled = torch.log_softmax(logprobs / request.temperature, -1)
        generator = _generator(request.seed, ALT_TOKENS_STREAM)
        tokens = torch.multinomial(scaled.exp(), k, replacement=True, generator=generator)
    return {"k": k, "tokens": tokens.tolist(), "logprobs": scaled.gather(-1, tokens).tolist()}


def _topk(logprobs: torch.Tensor, k: int) -> list[TopK]:
    """Per row of ``(positions, vocabulary)`` logprobs, its k likeliest tokens."""
    values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(tokens, values)) for tokens, values in zip(indices.tolist(), values.tolist())]
