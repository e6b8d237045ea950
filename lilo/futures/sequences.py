"""Recorded sequences: what a sample taken with ``record_stability_info`` leaves for ``stable_reinforce`` to train on.

A sequence is recorded in the transaction that completes its sample (the sample's result and its records are one
write), as ``<request_id>:<k>``, the id the client already got. It belongs to the session that owns the sampling
session, and can be trained on for a day after it was sampled; each training request that uses it restarts that
day (Tinker's rule). An expired sequence answers 410 for another day, then its row is pruned (404 from then on).
Kept in the futures DB's file, so records survive a restart of the service.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from sqlalchemy import bindparam, delete, select, update

from lilo.backend.provenance import RecordedSequence
from lilo.errors import GoneError, InvalidRequestError, NotFoundError
from lilo.futures.database import insert
from lilo.futures.schema import futures, sampled_sequences, sampling_sessions
from lilo.tenants import may_see

RECORD_TTL_S = 24 * 3600.0
# An expired record stays this long, so a late training request is told it expired rather than that it never was.
EXPIRED_KEPT_S = 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class RecordedSample:
    """Carried by a sample's completion: its prompt, and each returned sequence's tokens and sampler logprobs."""

    prompt: Sequence[int]
    sequences: Sequence[tuple[Sequence[int], Sequence[float]]]

    @classmethod
    def of(cls, prompt: Sequence[int], result: dict[str, Any]) -> "RecordedSample":
        return cls(list(prompt), [(list(s["tokens"]), list(s["logprobs"])) for s in result["sequences"]])


def insert_records(connection: Any, recorded: dict[int, RecordedSample], now: float) -> None:
    """Record the sequences of these finished samples (request id -> what it sampled), owned by the session and
    tenant of each sample's sampling session."""
    owners = {row.request_id: row for row in connection.execute(
        select(futures.c.request_id, sampling_sessions.c.session_id, futures.c.tenant)
        .join(sampling_sessions, sampling_sessions.c.sampling_session_id == futures.c.model_id)
        .where(futures.c.request_id.in_(list(recorded))))}
    rows = [{"sequence_id": f"{request_id}:{k}", "session_id": owners[request_id].session_id,
             "tenant": owners[request_id].tenant,
             "prompt": _int32(sample.prompt), "tokens": _int32(tokens),
             "logprobs": np.asarray(logprobs, dtype="<f4").tobytes(),
             "created_at": now, "expires_at": now + RECORD_TTL_S}
            for request_id, sample in recorded.items() if request_id in owners
            for k, (tokens, logprobs) in enumerate(sample.sequences)]
    if rows:
        upsert = insert(connection, sampled_sequences)
        connection.execute(upsert.on_conflict_do_update(index_elements=[sampled_sequences.c.sequence_id], set_={
            column: upsert.excluded[column] for column in rows[0] if column != "sequence_id"}), rows)


def take_for_training(connection: Any, model_id: str, model_session_id: str | None, sequence_ids: Sequence[str],
                      tenant: str | None, now: float) -> dict[str, RecordedSequence]:
    """The records that a training request of ``model_id`` (of session ``model_session_id``) names, their day
    restarted; raises, naming the first sequence that is unknown (or another tenant's), expired, or sampled in
    another session than the model's."""
    rows = {row.sequence_id: row for row in connection.execute(
        select(sampled_sequences).where(sampled_sequences.c.sequence_id.in_(list(sequence_ids))))}
    for sequence_id in sequence_ids:
        row = rows.get(sequence_id)
        if row is None or not may_see(tenant, row.tenant):
            raise NotFoundError(
                f"Unknown sequence_id {sequence_id!r}: no sequence recorded under it. stable_reinforce trains on "
                "sequences sampled with record_stability_info=True; pass the sequence_id a sample returned.")
        if row.expires_at < now:
            raise GoneError(
                f"sequence_id {sequence_id!r} expired: recorded sequences can be trained on for one day after "
                "sampling or after their last training use; sample again.")
        if row.session_id != model_session_id:
            raise InvalidRequestError(
                f"sequence_id {sequence_id!r} was sampled in session {row.session_id!r}, but model {model_id!r} "
                f"belongs to session {model_session_id!r}; a training request can only name sequences sampled in "
                "its own session, so sample and train in the same session.")
    connection.execute(update(sampled_sequences).where(sampled_sequences.c.sequence_id.in_(list(sequence_ids)))
                       .values(expires_at=now + RECORD_TTL_S))
    return {sequence_id: RecordedSequence(sequence_id, np.frombuffer(row.prompt, dtype="<i4"),
                                          np.frombuffer(row.tokens, dtype="<i4"),
                                          np.frombuffer(row.logprobs, dtype="<f4"))
            for sequence_id, row in rows.items()}


def prune_expired(connection: Any, now: float) -> int:
    """Delete records expired for longer than EXPIRED_KEPT_S; returns how many."""
    return connection.execute(delete(sampled_sequences)
                              .where(sampled_sequences.c.expires_at < bindparam("cutoff")),
                              {"cutoff": now - EXPIRED_KEPT_S}).rowcount


def _int32(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()
