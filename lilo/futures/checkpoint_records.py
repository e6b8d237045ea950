"""What lilo keeps about checkpoints beside their files: expiry (TTL) and publication, in the futures database.

The files of a checkpoint are the trainer's (``lilo.backend.checkpoints.index``); this is the one writer's record of
when each expires and whether other tenants may read it. The rules are pure functions (``access_refusal``,
``due_for_deletion``); ``CheckpointRecords`` reads and writes the rows on the futures DB's thread.

Public means readable by its tinker path: another tenant may read its info, get download links, sample it or load
it into a model of their own, but it is never listed to them, and only its tenant may delete it, set its TTL or
unpublish it.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Iterable, Sequence

import orjson
from sqlalchemy import Engine, select, update

from lilo.backend.checkpoints.paths import parse_tinker_path
from lilo.errors import GoneError, InvalidRequestError, NotFoundError
from lilo.futures.database import insert
from lilo.futures.schema import checkpoints, models
from lilo.tenants import may_see

MAX_BOUND_PARAMS = 32_000
MIN_TTL_S = 3600  # as Tinker documents: 1 hour to 10 years
MAX_TTL_S = 10 * 366 * 86400


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    tinker_path: str
    model_id: str
    tenant: str | None
    expires_at: float | None = None
    public: bool = False
    deleted_at: float | None = None  # set once the expiry sweep deleted its files

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


def expiry_for(ttl_seconds: Any, now: float) -> float | None:
    """When a checkpoint given ``ttl_seconds`` from ``now`` expires (None: never); a TTL out of range is refused."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidRequestError(f"ttl_seconds {ttl_seconds!r} is out of range; give a whole number of seconds from "
                                  f"{MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), or none for a checkpoint that "
                                  "never expires.")
    return now + ttl_seconds


def iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


def expired_error(record: CheckpointRecord) -> GoneError:
    return GoneError(f"Checkpoint {record.tinker_path!r} expired at {iso(record.expires_at)} (its TTL) and is "
                     "deleted; save a new one, and give checkpoints you want to keep a longer TTL (or none).")


def access_refusal(caller: str | None, run_tenant: str | None, record: CheckpointRecord | None, now: float,
                   write: bool = False) -> str | None:
    """Why ``caller`` may not use a checkpoint of a run of ``run_tenant`` (``record``: its row, if any), or None.
    ``"unknown"``: it answers as a checkpoint of no run (another tenant's private one, or any write by another
    tenant); ``"expired"``: its TTL has passed. Reading a public checkpoint is open to every tenant."""
    if not may_see(caller, run_tenant) and (write or record is None or not record.public):
        return "unknown"
    if record is not None and record.expired(now):
        return "expired"
    return None


def due_for_deletion(records: Iterable[CheckpointRecord], now: float) -> list[CheckpointRecord]:
    """The records whose checkpoints the expiry sweep deletes now: expired, and not deleted yet."""
    return [record for record in records if record.expired(now) and record.deleted_at is None]


def unknown_run_error(model_id: str) -> NotFoundError:
    return NotFoundError(f"Unknown model_id {model_id!r}; pass the model_id that create_model returned.")


class CheckpointRecords:
    """The ``checkpoints`` table; called on the futures DB's one writer thread."""

    def __init__(self, engine: Engine, clock) -> None:
        self._engine = engine
        self._clock = clock

    def record_save(self, path: str, tenant: str | None, expires_at: float | None) -> None:
        """A named save of ``path`` was accepted: it expires at ``expires_at`` (None: never), and a tombstone of an
        earlier checkpoint under the same path is lifted. Whether it is public stays as it was."""
        self._upsert(path, tenant, expires_at=expires_at, deleted_at=None)

    def set_expiry(self, path: str, tenant: str | None, expires_at: float | None) -> None:
        self._upsert(path, tenant, expires_at=expires_at)

    def set_public(self, path: str, tenant: str | None, public: bool) -> None:
        self._upsert(path, tenant, public=int(public))

    def forget(self, path: str) -> None:
        """The checkpoint was deleted by its tenant: nothing about it is kept."""
        with self._engine.begin() as connection:
            connection.execute(checkpoints.delete().where(checkpoints.c.tinker_path == path))

    def _upsert(self, path: str, tenant: str | None, **values: Any) -> None:
        model_id, _, _ = parse_tinker_path(path)
        with self._engine.begin() as connection:
            connection.execute(insert(connection, checkpoints).values(tinker_path=path, model_id=model_id,
                                                                      tenant=tenant, **{"public": 0, **values})
                               .on_conflict_do_update(index_elements=[checkpoints.c.tinker_path], set_=values))

    def of_runs(self, model_ids: Sequence[str]) -> dict[str, CheckpointRecord]:
        """``tinker path -> record`` of every recorded checkpoint of these runs."""
        found: dict[str, CheckpointRecord] = {}
        with self._engine.connect() as connection:
            for start in range(0, len(model_ids), MAX_BOUND_PARAMS):
                rows = connection.execute(select(checkpoints).where(
                    checkpoints.c.model_id.in_(model_ids[start:start + MAX_BOUND_PARAMS]))).mappings()
                found.update((row["tinker_path"], _record(row)) for row in rows)
        return found

    def readable(self, path: str, tenant: str | None,
                 write: bool = False) -> tuple[dict[str, Any], CheckpointRecord | None]:
        """(the run's model row, the checkpoint's record) when ``tenant`` may use the checkpoint ``path`` (to read,
        or with ``write`` to change or delete it); else the run's not-found error, or GoneError once it expired."""
        model_id, _, _ = parse_tinker_path(path)
        with self._engine.connect() as connection:
            run = connection.execute(select(models).where(models.c.model_id == model_id)).mappings().first()
            row = connection.execute(select(checkpoints).where(checkpoints.c.tinker_path == path)).mappings().first()
        record = None if row is None else _record(row)
        refusal = "unknown" if run is None else access_refusal(tenant, run["tenant"], record, self._clock(), write)
        if refusal == "unknown":
            raise unknown_run_error(model_id)
        if refusal == "expired":
            raise expired_error(record)
        user_metadata = run["user_metadata"]
        return ({**run, "lora_config": orjson.loads(run["lora_config"]),
                 "user_metadata": None if user_metadata is None else orjson.loads(user_metadata)}, record)

    def due(self) -> list[tuple[CheckpointRecord, str | None]]:
        """(record, the trainer of its run) of every checkpoint the expiry sweep should delete now."""
        with self._engine.connect() as connection:
            rows = connection.execute(
                select(checkpoints, models.c.trainer).join(models, models.c.model_id == checkpoints.c.model_id,
                                                           isouter=True)
                .where(checkpoints.c.expires_at <= self._clock(), checkpoints.c.deleted_at.is_(None))).mappings().all()
        now = self._clock()
        records = [(_record(row), row["trainer"]) for row in rows]
        due = {record.tinker_path for record in due_for_deletion([record for record, _ in records], now)}
        return [(record, trainer) for record, trainer in records if record.tinker_path in due]

    def mark_deleted(self, paths: Sequence[str]) -> None:
        with self._engine.begin() as connection:
            connection.execute(update(checkpoints).where(checkpoints.c.tinker_path.in_(list(paths)))
                               .values(deleted_at=self._clock()))


def _record(row: Any) -> CheckpointRecord:
    return CheckpointRecord(row["tinker_path"], row["model_id"], row["tenant"], row["expires_at"],
                            bool(row["public"]), row["deleted_at"])
