"""Tables of the futures database (SQLAlchemy Core)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger, Column, Float, Index, Integer, LargeBinary, MetaData, String, Table, Text, UniqueConstraint,
)

metadata = MetaData()

# A 64-bit integer in either database: SQLite's INTEGER is one already (and only ``INTEGER PRIMARY KEY`` is the
# rowid that AUTOINCREMENT needs); PostgreSQL's INTEGER is 32 bits, too few for ids, seqs and token counts.
BigInt = BigInteger().with_variant(Integer(), "sqlite")

PENDING, COMPLETED, FAILED = "pending", "completed", "failed"

futures = Table(
    "futures",
    metadata,
    # AUTOINCREMENT (PostgreSQL: BIGSERIAL's sequence): ids are never reused, so an id below the highest ever
    # allocated that has no row was pruned (lilo.futures.database.highest_request_id).
    Column("request_id", BigInt, primary_key=True, autoincrement=True),
    Column("model_id", String, nullable=False),
    Column("kind", String, nullable=False),  # a lilo.engine.commands.Kind (RENAMED_COLUMNS: once request_type)
    Column("seq_id", BigInt, nullable=True),
    Column("status", String, nullable=False, default=PENDING),
    # The payload's fingerprint, never the payload (it travels to its trainer directly): a retry with the same one
    # is the same request, another under the same seq a conflict. (Files written before kept a payload column;
    # nothing reads it.)
    Column("payload_sha256", String(64), nullable=False),
    Column("result", LargeBinary, nullable=True),
    Column("error", Text, nullable=True),
    Column("error_category", String, nullable=True),
    Column("tenant", String, nullable=True),
    Column("submitted_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    # The trainer the request was handed to, so a trainer's failure fails exactly its requests. Added after the
    # first release (nullable: an older file gains it on open).
    Column("trainer", String, nullable=True),
    # The order finished futures were written in: every write that finishes some stamps them with the next number
    # (lilo.futures.session_completions), so a sampling session's poll asks for what finished after its cursor.
    # Added after the first release (nullable: an older file gains it on open; its finished rows stay unnumbered).
    Column("finished_seq", BigInt, nullable=True),
    # What billing counts (lilo.futures.billing; added after the first release, nullable): a training pass's tokens,
    # or a sample's prompt tokens, at submit; a sample's generated tokens once it finished.
    Column("billed_tokens", BigInt, nullable=True),
    Column("sampled_tokens", BigInt, nullable=True),
    UniqueConstraint("model_id", "seq_id", name="uq_futures_model_seq"),
    sqlite_autoincrement=True,
)

# A failed trainer's unfinished requests (evacuate) and a start's leftovers (fail_all_pending) are found by these.
STATUS_TRAINER_INDEX = Index("ix_futures_status_trainer", futures.c.status, futures.c.trainer)
# Files written before the ledger kept an index for a payload scheduler that no longer exists; dropped on open, since
# every insert would keep paying for it.
RETIRED_INDEXES = ("ix_futures_pending_scan",)
# Columns an older file names otherwise: (table, old name, name now).
RENAMED_COLUMNS = (("futures", "request_type", "kind"),)
FINISHED_INDEX = Index("ix_futures_finished_at", futures.c.finished_at)
# A sampling session's samples finished after a cursor (retrieve_futures); samples only, so training's writes skip it.
SESSION_FINISHED_INDEX = Index("ix_futures_session_finished", futures.c.model_id, futures.c.finished_seq,
                               sqlite_where=futures.c.kind == "sample", postgresql_where=futures.c.kind == "sample")

models = Table(
    "models",
    metadata,
    Column("model_id", String, primary_key=True),
    Column("tenant", String, nullable=True),
    Column("session_id", String, nullable=True),
    Column("base_model", String, nullable=False),
    Column("lora_config", Text, nullable=False),
    Column("trainer", String, nullable=True),
    Column("created_at", Float, nullable=False),
    # Added after the first release: nullable, so an older file gains them with ALTER TABLE on open.
    Column("user_metadata", Text, nullable=True),
    # Set by unload_model: new requests for the model are refused; its row (and checkpoints) stay, as its run.
    Column("unloaded_at", Float, nullable=True),
    # Why lilo unloaded it itself (its base model is no longer served); None after the client's unload_model.
    Column("unloaded_reason", Text, nullable=True),
    # The highest seq id among its futures pruned so far: a model restored after all its futures are gone still
    # takes its client's next step, which comes with the seq after it.
    Column("pruned_seq", BigInt, nullable=True),
)

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", String, primary_key=True),
    Column("tenant", String, nullable=True),
    Column("metadata", Text, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("last_heartbeat_at", Float, nullable=False),
    # Added after the first release (nullable): how the client closed it, {"reason": {"type"}, "detail"}, as JSON.
    Column("finished", Text, nullable=True),
)

sampling_sessions = Table(
    "sampling_sessions",
    metadata,
    Column("sampling_session_id", String, primary_key=True),
    Column("session_id", String, nullable=False),
    Column("base_model", String, nullable=False),
    Column("model_path", String, nullable=True),
    Column("created_at", Float, nullable=False),
    # Added after the first release (nullable, so an older file gains it on open; NULL: the local tenant's).
    Column("tenant", String, nullable=True),
    # How many clients joined the session (join_sampling_session), each given the next count as its clone id.
    Column("clients", BigInt, nullable=True),
)

# Losses clients uploaded to run on the server (create_custom_loss): the graph as sent, checked again when read.
custom_losses = Table(
    "custom_losses",
    metadata,
    Column("loss_id", String, primary_key=True),  # <session_id>:loss:<custom_loss_seq_id>
    Column("session_id", String, nullable=False),
    Column("tenant", String, nullable=True),
    Column("body", Text, nullable=False),  # {"name", "inputs", "graph"} as JSON
    Column("created_at", Float, nullable=False),
)

# Sequences sampled with record_stability_info, for stable_reinforce (lilo.futures.sequences).
sampled_sequences = Table(
    "sampled_sequences",
    metadata,
    Column("sequence_id", String, primary_key=True),  # <request_id>:<k>, as the sample returned it
    Column("session_id", String, nullable=False),
    Column("tenant", String, nullable=True),
    Column("prompt", LargeBinary, nullable=False),  # int32 token ids of the request's prompt
    Column("tokens", LargeBinary, nullable=False),  # int32 sampled token ids
    Column("logprobs", LargeBinary, nullable=False),  # float32, the sampler's logprob of each sampled token
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)
SEQUENCES_EXPIRY_INDEX = Index("ix_sampled_sequences_expires_at", sampled_sequences.c.expires_at)

# What each tenant's requests counted against its rates (lilo.futures.admission), summed since the file was made:
# the futures DB actor adds what it admitted every few seconds.
tenant_usage = Table(
    "tenant_usage",
    metadata,
    Column("tenant", String, primary_key=True),
    Column("train_tokens", BigInt, nullable=False, default=0),
    Column("sample_tokens", BigInt, nullable=False, default=0),
    Column("requests", BigInt, nullable=False, default=0),
)

# What lilo keeps about a checkpoint beside its files (which the trainer of its run keeps): when it expires, whether
# it is public, and for one the expiry sweep deleted, when (so a later request says it expired, not that it never
# was). A row is written by every named save; a checkpoint without one never expires and is private.
checkpoints = Table(
    "checkpoints",
    metadata,
    Column("tinker_path", String, primary_key=True),
    Column("model_id", String, nullable=False),
    Column("tenant", String, nullable=True),
    Column("expires_at", Float, nullable=True),
    Column("public", Integer, nullable=False, default=0),
    Column("deleted_at", Float, nullable=True),
    Index("ix_checkpoints_model", "model_id"),
    Index("ix_checkpoints_expires", "expires_at"),
)
