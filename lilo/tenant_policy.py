"""What each tenant may have and send, and its share of a busy trainer: the tenants file (``--tenants-file``).

TOML, one ``[tenants.NAME]`` table per tenant (the names the API keys file gives) and a ``[default]`` table for
every tenant it does not name; a key a table leaves out is unlimited (``weight``: 1)::

    [default]
    max_models = 8

    [tenants.alice]
    weight = 2                    # her share of a trainer whose passes cannot hold every ready command
    max_models = 32               # models created and not unloaded
    max_rank = 64                 # LoRA rank of a new model
    base_models = ["Qwen/Qwen3-8B"]
    max_inflight = 64             # requests recorded and not yet finished
    train_tokens_per_min = 2_000_000
    sample_tokens_per_min = 500_000
    storage_gb = 50               # checkpoints kept (a save over it is refused)

    [tenants.ops]
    admin = true                  # its console (/console) shows every tenant's models, trainers and sessions

``admin`` is given per tenant only, never in ``[default]``; it changes what the console's overview shows and nothing
else. Limits on amounts are refused for good (a 4xx the SDK does not retry); limits on rates are 429s with Retry-After,
which the SDK waits out. ``PolicyFile`` re-reads the file when it changes (and on ``reload``), keeping the last good
policy, and saying why, when a new version does not parse.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import tomllib
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

# How often ``PolicyFile.current`` looks at the file's modification time.
CHECK_EVERY_S = 1.0


class TenantsFileError(ValueError):
    """The tenants file cannot be read or says something lilo does not take; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """One tenant's share and limits; None: no limit."""

    weight: float = 1.0
    max_models: int | None = None
    max_rank: int | None = None
    base_models: tuple[str, ...] | None = None
    max_inflight: int | None = None
    train_tokens_per_min: int | None = None
    sample_tokens_per_min: int | None = None
    storage_gb: float | None = None


ADMIN = "admin"
_INTEGERS = ("max_models", "max_rank", "max_inflight", "train_tokens_per_min", "sample_tokens_per_min")
FIELDS = tuple(field.name for field in dataclasses.fields(TenantLimits))


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    """Every tenant's limits: its own table's, else the default table's; and the tenants marked admin."""

    tenants: Mapping[str, TenantLimits] = dataclasses.field(default_factory=dict)
    default: TenantLimits = TenantLimits()
    admins: frozenset[str] = frozenset()

    def of(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)

    def is_admin(self, tenant: str) -> bool:
        return tenant in self.admins


def _limits(table: Any, where: str, base: TenantLimits) -> TenantLimits:
    """A ``[tenants.NAME]`` or ``[default]`` table as limits; keys it leaves out come from ``base``."""
    if not isinstance(table, dict):
        raise TenantsFileError(f"{where} must be a table of limits ({', '.join(FIELDS)}).")
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise TenantsFileError(f"{where} has unknown keys ({', '.join(unknown)}); use {', '.join(FIELDS)} (and "
                               "admin, in a [tenants.NAME] table).")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in _INTEGERS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TenantsFileError(f"{where}.{key} must be a whole number of at least 0, not {value!r}.")
        elif key == "base_models":
            if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
                raise TenantsFileError(f"{where}.base_models must be a list of base model names, not {value!r}.")
            value = tuple(value)
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                key == "weight" and value == 0):
            raise TenantsFileError(f"{where}.{key} must be a number above 0, not {value!r}.")
        values[key] = value
    return dataclasses.replace(base, **values)


def parse_tenants(text: str, source: str) -> TenantPolicy:
    """A tenants file's text as a policy; ``source`` names it in errors."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TenantsFileError(f"{source} is not valid TOML ({error}); fix it, then save it again.") from None
    unknown = sorted(set(document) - {"tenants", "default"})
    if unknown:
        raise TenantsFileError(f"{source} has unknown tables ({', '.join(unknown)}); use [default] and "
                               "[tenants.NAME].")
    default_table = document.get("default", {})
    if isinstance(default_table, dict) and ADMIN in default_table:
        raise TenantsFileError(f"{source}: [default] may not set admin (it would make every tenant one); set "
                               "admin = true in the [tenants.NAME] table of each tenant that administers.")
    default = _limits(default_table, f"{source}: [default]", TenantLimits())
    tenants = document.get("tenants", {})
    if not isinstance(tenants, dict):
        raise TenantsFileError(f"{source}: tenants must be tables, [tenants.NAME].")
    admins = frozenset(name for name, table in tenants.items()
                       if _admin(table, f"{source}: [tenants.{name}]"))
    # admin is no limit: taken out before the limits are read, so it never shows among them (lilo status --tenants)
    return TenantPolicy({name: _limits(_without_admin(table), f"{source}: [tenants.{name}]", default)
                         for name, table in tenants.items()}, default, admins)


def _admin(table: Any, where: str) -> bool:
    """Whether a ``[tenants.NAME]`` table marks its tenant admin (``admin = true``)."""
    value = table.get(ADMIN, False) if isinstance(table, dict) else False
    if not isinstance(value, bool):
        raise TenantsFileError(f"{where}.admin must be true or false, not {value!r}.")
    return value


def _without_admin(table: Any) -> Any:
    return {key: value for key, value in table.items() if key != ADMIN} if isinstance(table, dict) else table


def read_tenants_file(path: Path) -> TenantPolicy:
    try:
        text = path.read_text()
    except OSError as error:
        raise TenantsFileError(f"Cannot read the tenants file {path} ({error.strerror}); pass an existing file to "
                               "--tenants-file (LILO_TENANTS_FILE).") from None
    return parse_tenants(text, f"the tenants file {path}")


class PolicyFile:
    """The policy of a tenants file (None: everyone unlimited, weight 1), re-read when the file changes."""

    def __init__(self, path: str | Path | None, clock=time.monotonic) -> None:
        self.path = Path(path) if path else None
        self._clock = clock
        self._policy = TenantPolicy()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = float("-inf")
        self.error: str | None = None  # why the file's latest version was not taken
        if self.path is not None:
            self._policy = read_tenants_file(self.path)  # a bad file at startup is the operator's to fix now
            self._stamp = self._stamp_now()

    def _stamp_now(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)  # type: ignore[arg-type]
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def current(self) -> TenantPolicy:
        """The policy, re-read first when the file changed since it was last read (looked at once a second)."""
        now = self._clock()
        if self.path is not None and now - self._checked_at >= CHECK_EVERY_S:
            self._checked_at = now
            if self._stamp_now() != self._stamp:
                self.reload()
        return self._policy

    def reload(self) -> bool:
        """Re-read the file now (SIGHUP); on an error keep the last good policy and say why. True: it was taken."""
        if self.path is None:
            return True
        self._stamp = self._stamp_now()
        try:
            self._policy = read_tenants_file(self.path)
        except TenantsFileError as error:
            self.error = str(error)
            logger.error("%s; the tenants' previous limits stay in force", error)
            return False
        self.error = None
        logger.warning("read the tenants file %s: %d tenant(s) named", self.path, len(self._policy.tenants))
        return True
