"""Where the ledger lives, and what differs between its two homes.

By default the ledger is a SQLite file on the node of the futures DB actor (``lilo.futures.paths``); with
``--ledger postgresql://user:password@host:5432/lilo`` it is a PostgreSQL database (driven by psycopg 3), which
outlives the node. Either way one process writes it, the futures DB actor, on one thread. The store speaks
SQLAlchemy Core to both; what cannot be said the same way in both is here: the upsert's ``INSERT``, the two-argument
maximum, how the highest request id ever allocated is kept, the waiter's raw reads, sizes and housekeeping.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from lilo.futures.paths import is_ledger_url as is_url

logger = logging.getLogger(__name__)

DRIVER = "postgresql+psycopg"
CONNECT_TIMEOUT_S = 10
_SEQUENCE = "pg_get_serial_sequence('futures', 'request_id')"


class LedgerUnreachableError(RuntimeError):
    """The PostgreSQL ledger could not be opened; the message names it (never its password) and what to check."""


def shown(location: str | Path) -> str:
    """``location`` as logs and stats may show it: a URL without its password."""
    if not is_url(location):
        return str(location)
    return make_url(str(location)).render_as_string(hide_password=True)


def insert(bind: Any, table: Any) -> Any:
    """The dialect's ``INSERT`` of ``table``, with ``on_conflict_do_nothing`` / ``on_conflict_do_update`` (``bind``:
    an engine or a connection)."""
    return (postgresql.insert if bind.dialect.name == "postgresql" else sqlite.insert)(table)


def greatest(bind: Any, *values: Any) -> Any:
    """The larger of ``values`` in SQL: SQLite's ``max`` of several arguments is PostgreSQL's ``greatest``."""
    return (func.greatest if bind.dialect.name == "postgresql" else func.max)(*values)


def open_engine(location: str | Path, busy_timeout_ms: int) -> Engine:
    """The engine of the ledger at ``location``: a SQLite file's, or a PostgreSQL database's once it answers."""
    if not is_url(location):
        return _sqlite_engine(Path(location), busy_timeout_ms)
    engine = create_engine(make_url(location).set(drivername=DRIVER), pool_pre_ping=True,
                           connect_args=_postgres_connect_args(busy_timeout_ms))
    try:
        with engine.connect():
            pass
    except Exception as error:
        engine.dispose()
        reason = str(getattr(error, "orig", error)).strip().splitlines()[0]
        raise LedgerUnreachableError(
            f"The ledger {shown(location)} cannot be reached ({reason}). Check that PostgreSQL runs there and that "
            "this node reaches its host and port, and the user, password and database in --ledger (LILO_LEDGER); "
            "the database must exist.") from None
    return engine


def _postgres_connect_args(busy_timeout_ms: int) -> dict[str, Any]:
    # lock_timeout is what SQLite's busy timeout is: how long a statement waits for another's lock before it fails
    # (and the store retries it). Only a process beside the one writer could hold one.
    return {"connect_timeout": CONNECT_TIMEOUT_S, "application_name": "lilo-futures",
            "options": f"-c lock_timeout={int(busy_timeout_ms)}"}


def _sqlite_engine(path: Path, busy_timeout_ms: int) -> Engine:
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": busy_timeout_ms / 1000})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # Payloads are tens of KiB: larger pages mean fewer overflow pages per row (takes effect on a new file).
        cursor.execute("PRAGMA page_size=16384")
        cursor.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL loses at most the last commits on power loss, never consistency; FULL would fsync on
        # every commit.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.close()

    return engine


def highest_request_id(connection: Any) -> int:
    """The highest request id ever allocated, pruned or not: SQLite's AUTOINCREMENT keeps it in sqlite_sequence,
    PostgreSQL in the column's sequence."""
    if connection.dialect.name == "postgresql":
        value = connection.execute(text(f"SELECT pg_sequence_last_value({_SEQUENCE})")).scalar()
    else:
        value = connection.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'futures'").scalar()
    return int(value or 0)


def allocate_request_ids(connection: Any, count: int) -> int:
    """The first of ``count`` new consecutive request ids (the one writer inserts them itself). SQLite notes the
    highest once the rows are in; PostgreSQL's sequence is moved past them here (outside the transaction: ids of a
    transaction rolled back are never handed out again, as a pruned request's are not)."""
    if connection.dialect.name == "postgresql":
        last = connection.execute(text(f"SELECT setval({_SEQUENCE}, COALESCE(pg_sequence_last_value({_SEQUENCE}), 0)"
                                       " + :count)"), {"count": count}).scalar_one()
        return int(last) - count + 1
    return highest_request_id(connection) + 1


def after_prune(engine: Engine) -> None:
    """Give back what pruning freed: SQLite folds its write-ahead log into the file (PostgreSQL's autovacuum does
    its part on its own)."""
    if engine.dialect.name == "sqlite":
        with engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")


def sizes_mb(engine: Engine, path: Path | None) -> tuple[float, float]:
    """(database, write-ahead log) sizes in MiB: the SQLite file and its log; PostgreSQL's database (its log is the
    server's, 0 here)."""
    if path is None:
        with engine.connect() as connection:
            return connection.execute(text("SELECT pg_database_size(current_database())")).scalar_one() / 2**20, 0.0
    wal = path.with_name(path.name + "-wal")
    return (path.stat().st_size / 2**20, wal.stat().st_size / 2**20 if wal.exists() else 0.0)


class Reader:
    """The waiter's per-tick reads, off the pool: one long-lived connection and plain driver calls (``mark`` is the
    driver's placeholder). SQLite: WAL readers see every commit and never block the writer. PostgreSQL: autocommit,
    so no read holds a transaction open; a connection the server dropped is opened again and the read retried once."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self.mark = "%s" if self._postgres else "?"
        self._lock = threading.Lock()
        self._connection = self._open()

    def _open(self) -> Any:
        if not self._postgres:
            return self._engine.raw_connection().driver_connection
        import psycopg

        args, params = self._engine.dialect.create_connect_args(self._engine.url)
        return psycopg.connect(*args, **{**params, **_postgres_connect_args(0)}, autocommit=True)

    def read(self, sql: str, params: tuple) -> list[tuple]:
        with self._lock:
            if not self._postgres:
                return self._connection.execute(sql, params).fetchall()
            import psycopg

            try:
                try:
                    return self._connection.execute(sql, params).fetchall()
                except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                    if not (self._connection.closed or self._connection.broken):
                        raise
                    logger.warning("the ledger's reader lost its connection (%s); opening another", error)
                    self._connection = self._open()
                    return self._connection.execute(sql, params).fetchall()
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                # As the pool's connections raise it: callers retry what OperationalError says, whichever database.
                raise OperationalError(sql, params, error) from error

    def close(self) -> None:
        with self._lock:
            self._connection.close()
