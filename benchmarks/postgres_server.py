"""A throwaway PostgreSQL server on this machine, for the ledger's tests (tests/conftest.py) and bench_futures.py.

``postgres_server()`` makes a cluster in a temp directory (``initdb``, trust authentication: nothing but this
machine's loopback reaches it), starts it on a free port of 127.0.0.1 with its socket in that directory, and stops
and removes it afterwards. PostgreSQL refuses to run as root, so as root it runs as the ``postgres`` user.
Each caller takes a database of its own (``create_database``).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

SUPERUSER = "postgres"
MISSING = ("PostgreSQL's server programs (initdb, pg_ctl) are not installed; install Debian's postgresql package "
           "(apt-get install postgresql) to run the ledger's PostgreSQL tests and benchmark.")
# For tests: nothing is flushed to disk (a crash loses the server, which is thrown away anyway).
NO_FSYNC = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def server_programs() -> Path:
    """The directory with initdb and pg_ctl: on the PATH, else Debian's newest /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("initdb")
    candidates = ([Path(on_path).resolve().parent] if on_path else []) + [
        Path(found) for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for directory in candidates:
        if (directory / "initdb").exists() and (directory / "pg_ctl").exists():
            return directory
    raise RuntimeError(MISSING)


class PostgresServer:
    """A cluster in ``root`` (made by ``postgres_server``) served on 127.0.0.1:``port``."""

    def __init__(self, programs: Path, root: Path, settings: dict[str, str] | None = None) -> None:
        self._programs = programs
        self._root = root
        self._settings = {"listen_addresses": "127.0.0.1", **(settings or {})}
        self._as_owner = ["runuser", "-u", SUPERUSER, "--"] if os.geteuid() == 0 else []
        self._names = itertools.count()
        self.port = 0
        self.running = False

    def run(self, program: str, *args: object) -> None:
        done = subprocess.run([*self._as_owner, str(self._programs / program), *map(str, args)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stdout[-1000:]}{done.stderr[-1000:]}")

    def start(self) -> None:
        """Serve on a free port (the same one again after ``stop``)."""
        from cluster.ports import free_ports  # here: the library's tests import this module, and never cluster

        for _ in range(3):  # a free port may be taken before the server binds it
            self.port = self.port or free_ports(1)[0]
            flags = " ".join([f"-p {self.port}", f"-k {self._root / 'sockets'}",
                              *(f"-c {key}={value}" for key, value in self._settings.items())])
            try:
                self.run("pg_ctl", "-D", self._root / "data", "-l", self._root / "server.log", "-w", "-o", flags,
                         "start")
                self.running = True
                return
            except RuntimeError:
                self.port = 0
        log = (self._root / "server.log").read_text() if (self._root / "server.log").exists() else ""
        raise RuntimeError(f"PostgreSQL did not start on 127.0.0.1:\n{log[-2000:]}")

    def stop(self) -> None:
        self.run("pg_ctl", "-D", self._root / "data", "-m", "fast", "-w", "stop")
        self.running = False

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        """The server's ``database`` as ``--ledger`` takes it (a password is accepted and ignored: trust)."""
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{SUPERUSER}{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self, password: str | None = None) -> str:
        """A new, empty database; returns its URL (with ``password`` in it, which trust ignores)."""
        import psycopg

        name = f"ledger_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
                             autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name, password)


@contextlib.contextmanager
def postgres_server(settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """A running server (``settings``: its -c options, such as NO_FSYNC), stopped and removed on exit."""
    programs = server_programs()
    root = Path(tempfile.mkdtemp(prefix="lilo-pg-", dir="/tmp"))
    (root / "sockets").mkdir()
    if os.geteuid() == 0:
        for path in (root, root / "sockets"):
            shutil.chown(path, SUPERUSER, SUPERUSER)
    server = PostgresServer(programs, root, settings)
    try:
        server.run("initdb", "-D", root / "data", "-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--locale=C",
                   "--no-sync")
        server.start()
        yield server
    finally:
        if server.running:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
