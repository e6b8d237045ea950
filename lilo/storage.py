"""Storage: the files users keep (checkpoints, their exports, page files) under one URI, through pyarrow's
filesystems (the layer Ray's own storage uses): a directory on this node (the default: the home), a directory every
node mounts, or an object store (``s3://bucket/prefix``, ``gs://bucket/prefix``; pyarrow reads the cloud's usual
credentials, and takes options in the URI's query, e.g. ``?endpoint_override=http://host:9000`` for MinIO).

Paths inside are relative, ``/``-separated, and built by the callers from checked names only. An object store has
no directories and no rename: a tree is whole when its marker file is, so uploads write the marker last and
deletions remove it first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import pyarrow.fs as pafs

from lilo.errors import UnavailableError


# The storage's top-level directories: checkpoints (and their exports) and page files, each as laid out below them.
CHECKPOINTS, PAGES = "checkpoints", "pages"
DOWNLOAD_CHUNK = 64 << 20


class StorageError(UnavailableError):
    """The storage could not be read or written (unreachable, refused credentials, full): a 503, or a failed
    future of category "server"."""


class Storage:
    """Files under ``uri``: reads, listings, uploads of local trees and downloads of stored ones."""

    def __init__(self, uri: str | Path) -> None:
        text = str(uri)
        if "://" in text and not text.startswith("file://"):
            try:
                self.fs, self.base = pafs.FileSystem.from_uri(text)
            except (ValueError, OSError) as error:
                raise StorageError(f"--storage {redacted(text)} is not a storage lilo can open ({error}); pass "
                                   "s3://bucket/prefix, gs://bucket/prefix or a directory.") from None
            self.base = self.base.rstrip("/")
        else:
            self.fs = pafs.LocalFileSystem()
            self.base = str(Path(text.removeprefix("file://")).expanduser().absolute())
        self.uri = text
        self._signer: Any = None

    @property
    def is_local(self) -> bool:
        """Whether the files are plain files of this node's filesystem (a local disk or a mount)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def local_path(self, relative: str) -> Path:
        """The file or directory ``relative`` on this node's filesystem (local storage only)."""
        assert self.is_local, "an object store has no local paths"
        return Path(self.base, relative)

    def __repr__(self) -> str:
        return f"Storage({redacted(self.uri)})"

    def child(self, relative: str) -> "Storage":
        """The storage under ``relative`` of this one."""
        clone = object.__new__(Storage)
        clone.fs, clone.base, clone._signer = self.fs, self._key(relative), self._signer
        parts = urlsplit(self.uri)
        clone.uri = urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{relative}"))
        return clone

    def _key(self, relative: str) -> str:
        return f"{self.base}/{relative}" if relative else self.base

    def signed_url(self, relative: str, lifetime_s: int) -> str | None:
        """A URL that reads the file ``relative`` for ``lifetime_s`` seconds without credentials, where the storage
        signs such URLs: S3 (and S3-compatible stores), through botocore. None elsewhere (a directory, GCS): the
        caller serves the file itself."""
        if urlsplit(self.uri).scheme != "s3":
            return None
        if self._signer is None:
            self._signer = _s3_signer(self.uri)
        bucket, _, key = self._key(relative).partition("/")
        return self._signer.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                   ExpiresIn=lifetime_s)

    def probe(self) -> None:
        """Write, read back and delete a small file: StorageError, with a sentence, unless all three work."""
        relative = f".lilo-probe-{os.getpid()}"
        self.write(relative, b"lilo")
        try:
            if self.read(relative) != b"lilo":
                raise StorageError(f"The storage {redacted(self.uri)} did not give back what lilo wrote to it.")
        finally:
            self.delete(relative)

    # --- reading -------------------------------------------------------------------------------------------
    def files(self, relative: str) -> dict[str, pafs.FileInfo]:
        """The plain files directly in the directory ``relative`` by name (empty when there is none)."""
        return {Path(info.path).name: info for info in self._listing(relative, recursive=False)
                if info.type == pafs.FileType.File}

    def tree(self, relative: str) -> dict[str, pafs.FileInfo]:
        """Every plain file under the directory ``relative``, by its path below it (empty when there is none)."""
        prefix = len(self._key(relative)) + 1
        return {info.path[prefix:]: info for info in self._listing(relative, recursive=True)
                if info.type == pafs.FileType.File}

    def _listing(self, relative: str, recursive: bool) -> list[pafs.FileInfo]:
        with _storage_errors(self, "list", relative):
            return self.fs.get_file_info(pafs.FileSelector(self._key(relative), recursive=recursive,
                                                           allow_not_found=True))

    def read(self, relative: str, offset: int = 0, length: int | None = None) -> bytes:
        """Up to ``length`` bytes of the file ``relative`` from ``offset`` (all of it by default);
        FileNotFoundError when there is none."""
        with _storage_errors(self, "read", relative):
            with self.fs.open_input_file(self._key(relative)) as opened:
                size = opened.size()
                count = size - offset if length is None else min(length, max(size - offset, 0))
                return opened.read_at(count, offset) if count > 0 else b""

    # --- writing -------------------------------------------------------------------------------------------
    def write(self, relative: str, data: bytes) -> None:
        with _storage_errors(self, "write", relative):
            if self.is_local:
                self.local_path(relative).parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_output_stream(self._key(relative)) as opened:
                opened.write(data)

    def upload_file(self, local: Path, relative: str) -> None:
        """The local file ``local`` to ``relative``: whole or not at all (an object store's put is; in a
        directory, a hidden staging file is renamed into place)."""
        with _storage_errors(self, "upload", relative):
            if self.is_local:
                target = self.local_path(relative)
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.with_name(f".{target.name}.uploading-{os.getpid()}")
                shutil.copyfile(local, staging)
                os.replace(staging, target)
                return
            pafs.copy_files(str(local), self._key(relative), source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)

    def upload_tree(self, local: Path, relative: str, marker: str) -> None:
        """The plain files of the local directory ``local`` to ``relative``, ``marker`` last (after its old copy
        is deleted first, so a rewrite cut short never passes for whole); files there that ``local`` lacks go."""
        names = sorted(entry.name for entry in local.iterdir() if entry.is_file())
        self.delete(f"{relative}/{marker}")
        for stale in set(self.files(relative)) - set(names):
            self.delete(f"{relative}/{stale}")
        for name in (name for name in names if name != marker):
            self.upload_file(local / name, f"{relative}/{name}")
        if marker in names:
            self.upload_file(local / marker, f"{relative}/{marker}")

    def download_tree(self, relative: str, local: Path, marker: str) -> None:
        """The files of the stored directory ``relative`` into ``local``, replacing it whole (a staging directory
        renamed into place); FileNotFoundError when ``marker`` is not stored there."""
        stored = self.files(relative)
        if marker not in stored:
            raise FileNotFoundError(f"{redacted(self.uri)}/{relative}/{marker}")
        staging = local.with_name(f".{local.name}.fetching-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            for name in (name for name in stored if name != marker):
                self.download_file(f"{relative}/{name}", staging / name)
            self.download_file(f"{relative}/{marker}", staging / marker)
            if local.is_dir():
                retired = local.with_name(f".{local.name}.retired-{os.getpid()}")
                local.rename(retired)
                shutil.rmtree(retired, ignore_errors=True)
            staging.rename(local)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def download_file(self, relative: str, local: Path) -> None:
        """The file ``relative`` to the local file ``local``, in ranges of ``DOWNLOAD_CHUNK`` (one request each on
        an object store: pyarrow's streaming copy asks for small ranges, tens of times slower)."""
        with _storage_errors(self, "download", relative):
            local.parent.mkdir(parents=True, exist_ok=True)
            if self.is_local:
                shutil.copyfile(self.local_path(relative), local)
                return
            with self.fs.open_input_file(self._key(relative)) as source, open(local, "wb") as target:
                size = source.size()
                for offset in range(0, size, DOWNLOAD_CHUNK):
                    target.write(source.read_at(min(DOWNLOAD_CHUNK, size - offset), offset))

    def copy_tree(self, source: str, destination: str, marker: str) -> None:
        """The files of ``source`` to ``destination`` within this storage, ``marker`` last."""
        with _storage_errors(self, "copy", destination):
            if self.is_local:
                self.local_path(destination).mkdir(parents=True, exist_ok=True)
            for name in sorted(self.files(source), key=lambda name: (name == marker, name)):
                self.fs.copy_file(self._key(f"{source}/{name}"), self._key(f"{destination}/{name}"))

    def delete(self, relative: str) -> None:
        """Remove the file ``relative`` (nothing when there is none)."""
        with _storage_errors(self, "delete", relative):
            try:
                self.fs.delete_file(self._key(relative))
            except FileNotFoundError:
                pass

    def delete_tree(self, relative: str, marker: str | None = None) -> None:
        """Remove the directory ``relative`` and everything in it, ``marker`` first (so a deletion cut short
        leaves no whole-looking tree behind)."""
        if marker is not None:
            self.delete(f"{relative}/{marker}")
        with _storage_errors(self, "delete", relative):
            try:
                self.fs.delete_dir(self._key(relative))
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def _storage_errors(storage: Storage, doing: str, relative: str) -> Iterator[None]:
    """The filesystem's errors (other than a missing file) as a StorageError naming the storage and what was being
    done."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except OSError as error:
        raise StorageError(f"Could not {doing} {relative!r} in the storage {redacted(storage.uri)} ({error}); check "
                           "that it is reachable and that lilo's credentials may use it.") from error


def _s3_signer(uri: str) -> Any:
    """A botocore S3 client that signs URLs for the store ``uri`` names: its credentials (in the URI, else botocore's
    usual chain: the environment, ~/.aws, an instance profile), region and endpoint (``endpoint_override`` and
    ``scheme`` in the query, as pyarrow takes them; path-style addressing there, as MinIO and most S3-compatible
    stores want)."""
    import botocore.session
    from botocore.config import Config

    parts = urlsplit(uri)
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    options: dict[str, Any] = {"region_name": query.get("region") or os.environ.get("AWS_REGION") or "us-east-1",
                               "config": Config(signature_version="s3v4",
                                                s3={"addressing_style": "path" if "endpoint_override" in query
                                                    else "auto"})}
    access, secret = parts.username or query.get("access_key"), parts.password or query.get("secret_key")
    if access and secret:
        options.update(aws_access_key_id=unquote(access), aws_secret_access_key=unquote(secret))
    endpoint = query.get("endpoint_override")
    if endpoint:
        options["endpoint_url"] = endpoint if "://" in endpoint else f"{query.get('scheme', 'https')}://{endpoint}"
    return botocore.session.get_session().create_client("s3", **options)


def redacted(uri: str) -> str:
    """``uri`` without its query and any password (what logs and messages may show)."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
