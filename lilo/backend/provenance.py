"""Provenance: which sampled sequence each token of a training datum came from, resolved against what the sampler
recorded (``record_stability_info``), for the losses that need the sampler's own view of those tokens.

A datum's provenance is two lists of runs (the SDK's ``Datum.with_provenance``): one tiling its input tokens, one
tiling its targets. A ``prompt`` run says "these positions are positions [offset, offset + length) of the prompt of
the request that sampled sequence X"; a ``sampled`` run says the same of X's sampled tokens. Resolving checks every
claim against the record (the runs tile the datum; each token is the one recorded there) and gives the loss, per
target position, the sampler's recorded logprob and whether the target is a sampled token at all.

Pure functions of plain data: no database, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from lilo.errors import InvalidRequestError

PROMPT, SAMPLED = "prompt", "sampled"
# Loss inputs the server adds from the records; a client may not send them (they would pass for recorded values).
RECORDED_LOGPROBS = "recorded_logprobs"
RECORDED_MASK = "recorded_mask"
RECORDED_INPUTS = (RECORDED_LOGPROBS, RECORDED_MASK)


@dataclasses.dataclass(frozen=True)
class Span:
    """One run of a provenance list."""

    kind: str  # PROMPT or SAMPLED
    sequence_id: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Provenance:
    model_input: tuple[Span, ...]
    loss_fn_inputs: tuple[Span, ...]

    def sequence_ids(self) -> set[str]:
        return {span.sequence_id for span in (*self.model_input, *self.loss_fn_inputs)}


@dataclasses.dataclass(frozen=True)
class RecordedSequence:
    """What the sampler recorded of one returned sequence: its request's prompt, the tokens it sampled, and the
    logprob of each sampled token under the distribution it was drawn from."""

    sequence_id: str
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per sampled token


def named_sequences(provenances: Iterable[Provenance | None]) -> list[str]:
    """Every sequence id the provenances name, sorted."""
    return sorted(set().union(*(p.sequence_ids() for p in provenances if p is not None)))


def recorded_inputs(index: int, tokens: np.ndarray, target_tokens: np.ndarray, provenance: Provenance,
                    records: Mapping[str, RecordedSequence]) -> dict[str, np.ndarray]:
    """Per target position: ``recorded_logprobs`` (the sampler's logprob of a sampled target, 0 elsewhere) and
    ``recorded_mask`` (1 where the target is a sampled token). Raises InvalidRequestError, naming datum ``index``
    and the run, when the runs do not tile the datum or claim a token the record does not have there."""
    _check_claims(index, "model_input", tokens, provenance.model_input, records)
    _check_claims(index, "loss_fn_inputs", target_tokens, provenance.loss_fn_inputs, records)
    logprobs = np.zeros(len(target_tokens), dtype=np.float32)
    mask = np.zeros(len(target_tokens), dtype=np.float32)
    position = 0
    for span in provenance.loss_fn_inputs:
        if span.kind == SAMPLED:
            recorded = records[span.sequence_id].logprobs[span.offset:span.offset + span.length]
            logprobs[position:position + span.length] = recorded
            mask[position:position + span.length] = 1.0
        position += span.length
    return {RECORDED_LOGPROBS: logprobs, RECORDED_MASK: mask}


def _check_claims(index: int, field: str, tokens: np.ndarray, spans: Sequence[Span],
                  records: Mapping[str, RecordedSequence]) -> None:
    covered = sum(span.length for span in spans)
    if covered != len(tokens):
        what = "the input tokens" if field == "model_input" else "target_tokens"
        raise InvalidRequestError(
            f"Datum {index}: the {field} provenance spans cover {covered} positions but {what} has {len(tokens)}; "
            "the runs must tile it exactly (Datum.with_provenance checks this client-side).")
    position = 0
    for n, span in enumerate(spans):
        record = records[span.sequence_id]
        source = record.prompt if span.kind == PROMPT else record.tokens
        where = f"Datum {index}: {field} span {n} ({span.kind} tokens of sequence {span.sequence_id!r}"
        if span.offset < 0 or span.length < 0 or span.offset + span.length > len(source):
            raise InvalidRequestError(
                f"{where}, offset {span.offset}, length {span.length}) reaches past the {len(source)} "
                f"{span.kind} tokens that sequence has; fix the span's offset or length.")
        claimed = tokens[position:position + span.length]
        if not np.array_equal(claimed, source[span.offset:span.offset + span.length]):
            raise InvalidRequestError(
                f"{where}) names tokens that differ from the ones recorded there; the span must cover exactly the "
                "tokens that sequence's request prompted or sampled.")
        position += span.length
