"""Where the futures database lives: a SQLite file, node-local by default and never silently on a network filesystem;
or a PostgreSQL database named by its URL (``--ledger``; lilo.futures.database)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# SQLite's locking and WAL need a local filesystem; on these, "database is locked" and corruption follow.
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs",
                       "beegfs", "afs", "sshfs", "virtiofs"}


LEDGER_URL_PREFIXES = ("postgresql://", "postgres://", "postgresql+psycopg://")


def default_db_path(home: Path) -> Path:
    return home / "futures.db"


def is_ledger_url(location: str | Path) -> bool:
    """Whether ``location`` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(location, str) and location.startswith(LEDGER_URL_PREFIXES)


def filesystem_type(path: Path, mounts_file: Path = Path("/proc/mounts")) -> str | None:
    """The type of the filesystem holding ``path`` (longest matching mount point), or None when unknown."""
    try:
        mounts = mounts_file.read_text().splitlines()
    except OSError:
        return None
    resolved = str(path.resolve())
    best, best_type = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def is_network_filesystem(fs_type: str | None) -> bool:
    return fs_type is not None and (fs_type in NETWORK_FILESYSTEMS or fs_type.startswith("fuse"))


def prepare_db_path(path: Path) -> Path:
    """Create the parent directories and warn when the file would sit on a network or FUSE filesystem."""
    path = path.expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fs_type = filesystem_type(path.parent)
    if is_network_filesystem(fs_type):
        logger.warning(
            "The futures database %s is on a %s filesystem, where SQLite's locking and WAL are unreliable "
            "(\"database is locked\", lost writes). Point it at a node-local disk (for example under %s).",
            path, fs_type, os.environ.get("TMPDIR", "/tmp"))
    return path
