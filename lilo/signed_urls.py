"""Signed, expiring download links for checkpoint files (``RestClient.get_external_weights_urls``).

A link names one file of one checkpoint, the tenant it was signed for and when it expires, and carries an HMAC-SHA256
of exactly those under a secret that lives only in the lilo home (``<home>/url-signing-secret``, mode 0600, made on
the first start). The download route needs no API key (``urllib`` sends none): the signature is the credential, and
is checked before anything else, so a link someone altered (another file, checkpoint, tenant or expiry) is a 403. A
valid link still serves only while the tenant it was signed for may read the checkpoint (its own, or public), so
unpublishing or deleting a checkpoint ends its links too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

SECRET_FILE = "url-signing-secret"
LINK_LIFETIME_S = 3600


@dataclasses.dataclass(frozen=True)
class DownloadGrant:
    """What one signed link lets its holder download, and until when (whole seconds since the epoch)."""

    tenant: str
    tinker_path: str
    file: str
    expires_at: int

    def message(self) -> bytes:
        # A JSON array: no two different grants share a message, whatever their fields (they come from a URL) hold;
        # ensure_ascii also writes an unpaired surrogate as an escape instead of failing.
        return json.dumps(["lilo-download-v1", self.tenant, self.tinker_path, self.file, self.expires_at],
                          ensure_ascii=True).encode()


def signature(secret: bytes, grant: DownloadGrant) -> str:
    return hmac.new(secret, grant.message(), hashlib.sha256).hexdigest()


def refusal(secret: bytes, grant: DownloadGrant, offered: str, now: float,
            renewal: str = "get_external_weights_urls") -> str | None:
    """Why a link with ``offered`` as its signature may not download ``grant`` now, as a sentence naming the call
    that gives new links (``renewal``); None: it may."""
    # compare_digest takes only ASCII strings; a signature is hex, so anything else is no signature.
    if not offered.isascii() or not hmac.compare_digest(signature(secret, grant), offered):
        return f"This download link is not one lilo signed (or it was altered); ask {renewal} for new links."
    if grant.expires_at <= now:
        return f"This download link has expired; ask {renewal} for new links."
    return None


def secret_file(home: Path) -> Path:
    """The signing secret's file under ``home``, made (32 random bytes, readable by its owner only) if missing."""
    path = home / SECRET_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another start made it just now
            return path
        with os.fdopen(descriptor, "w") as written:
            written.write(secrets.token_hex(32))
    return path


def read_secret(path: Path) -> bytes:
    return bytes.fromhex(path.read_text().strip())
