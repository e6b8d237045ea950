"""API keys, each naming a tenant, and the answer to "which tenant sends this request?".

Keys come from ``LILO_API_KEYS`` (comma-separated entries) and/or a file (one entry per line, ``#`` comments); an
entry is ``tml-<key>=<tenant>``, or a bare ``tml-<key>``, a tenant of its own named ``key-<12 hex digits of its
SHA-256>`` (so the key itself is never stored as a name). With no keys configured lilo is in local mode: every
``tml-`` key is accepted and all of them are the one tenant ``local``. The service keeps only SHA-256 digests of
the keys, so the plain keys never travel into Ray (deployment arguments, logs, the dashboard).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, Mapping

from lilo.tenants import LOCAL_TENANT

KEY_PREFIX = "tml-"  # what the tinker SDK demands of a key
HEADER = "X-API-Key"
KEY_PATTERN = re.compile(r"^tml-[A-Za-z0-9._~+/-]{4,256}$")
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ApiKeyConfigError(ValueError):
    """A configured key or tenant is malformed; the message says which and how to fix it."""


class Unauthorized(Exception):
    """A request without a usable API key (HTTP 401); the message says what to send."""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_entries(entries: Iterable[str], source: str) -> dict[str, str]:
    """``key -> tenant`` of ``key[=tenant]`` entries (blank ones skipped); ``source`` names them in errors."""
    tenants: dict[str, str] = {}
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        key, separator, tenant = (part.strip() for part in entry.partition("="))
        if not KEY_PATTERN.match(key):
            raise ApiKeyConfigError(
                f"An API key in {source} is malformed: keys start with {KEY_PREFIX!r} followed by 4 to 256 letters, "
                "digits or . _ ~ + / - (and no spaces, commas or '=').")
        if not separator:
            tenant = f"key-{digest(key)[:12]}"
        elif not TENANT_PATTERN.match(tenant):
            raise ApiKeyConfigError(f"Tenant {tenant!r} in {source} is not a name: use up to 64 letters, digits, "
                                    "'.', '_' or '-', starting with a letter or digit.")
        if tenants.get(key, tenant) != tenant:
            raise ApiKeyConfigError(f"A key in {source} is given two tenants; give each key one.")
        tenants[key] = tenant
    return tenants


def read_keys_file(path: Path) -> dict[str, str]:
    """``key -> tenant`` from a keys file: one ``key[=tenant]`` per line, ``#`` starts a comment."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ApiKeyConfigError(f"Cannot read the API keys file {path} ({error.strerror}); pass an existing file "
                                "to --api-keys-file (LILO_API_KEYS_FILE).") from None
    return parse_entries((line.split("#", 1)[0] for line in text.splitlines()), f"the API keys file {path}")


def load_key_digests(env_value: str | None, keys_file: Path | None) -> dict[str, str]:
    """``sha256(key) -> tenant`` of every configured key (from both sources); empty: local mode."""
    tenants = parse_entries((env_value or "").split(","), "LILO_API_KEYS")
    for key, tenant in (read_keys_file(keys_file) if keys_file else {}).items():
        if tenants.get(key, tenant) != tenant:
            raise ApiKeyConfigError("A key in LILO_API_KEYS has another tenant in the API keys file; give each key "
                                    "one tenant.")
        tenants[key] = tenant
    return {digest(key): tenant for key, tenant in tenants.items()}


class ApiKeys:
    """Resolves a request's key to its tenant, from the configured digests (none: local mode)."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        self._digests = dict(digests)

    @property
    def local(self) -> bool:
        return not self._digests

    def tenant_for(self, key: str | None) -> str:
        """The tenant sending ``key``; raises Unauthorized, with what to send instead, for any other key."""
        if not key:
            raise Unauthorized(f"This request has no API key; send one in the {HEADER} header (the tinker SDK "
                               f"sends TINKER_API_KEY). {self._hint()}")
        if not key.startswith(KEY_PREFIX):
            raise Unauthorized(f"API keys start with {KEY_PREFIX!r}; set TINKER_API_KEY to such a key. {self._hint()}")
        if self.local:
            return LOCAL_TENANT
        tenant = self._digests.get(digest(key))
        if tenant is None:
            raise Unauthorized("Unknown API key; set TINKER_API_KEY to a key this server's operator configured "
                               "(LILO_API_KEYS or --api-keys-file).")
        return tenant

    def _hint(self) -> str:
        if self.local:
            return "This server runs in local mode: any key starting with 'tml-' works, e.g. tml-local."
        return "Ask this server's operator for a key."
