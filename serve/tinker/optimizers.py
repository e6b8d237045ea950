"""The optimizer a model trains with, as the SDK says it: its family at creation (``optimizer_config``: AdamW by
default, or Dimuon) and each step's settings (``adam_params`` for AdamW, ``optimizer_params`` of its ``type``
otherwise), checked into the backend's types. Each refusal says what to send instead."""

from __future__ import annotations

from typing import Any, Mapping

from lilo.backend.types import OPTIMIZERS, AdamParams, DimuonParams
from lilo.errors import InvalidRequestError

STEP_KEYS = {"adamw": ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"),
             "dimuon": ("learning_rate", "grad_clip_norm", "beta1")}
VERSIONS = {"adamw": (None,), "dimuon": (None, 1)}


def optimizer_family(config: Mapping[str, Any] | None) -> str:
    """``create_model``'s (or create-via-load's) ``optimizer_config``: ``adamw`` when none is sent."""
    if not config:
        return "adamw"
    family = config.get("type", "adamw")
    if family not in OPTIMIZERS:
        raise InvalidRequestError(f"Unknown optimizer {family!r}; use one of {', '.join(OPTIMIZERS)}.")
    extra = sorted(set(config) - {"type", "version"})
    if extra or config.get("version") not in VERSIONS[family]:
        takes = "type" if family == "adamw" else "type and version 1"
        raise InvalidRequestError(f"optimizer_config for {family} takes {takes} only; got {dict(config)!r}.")
    return family


def step_params(adam_params: Mapping[str, Any] | None,
                optimizer_params: Mapping[str, Any] | None) -> AdamParams | DimuonParams:
    """An ``optim_step``'s settings: its ``optimizer_params`` (``type`` names the family), else its ``adam_params``."""
    if optimizer_params is None:
        return _params("adamw", adam_params or {})
    family = optimizer_params.get("type")
    if family not in OPTIMIZERS:
        raise InvalidRequestError(f"optimizer_params needs a type, one of {', '.join(OPTIMIZERS)}; got {family!r}.")
    return _params(family, {key: value for key, value in optimizer_params.items() if key != "type"})


def _params(family: str, raw: Mapping[str, Any]) -> AdamParams | DimuonParams:
    known = STEP_KEYS[family]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidRequestError(f"Unknown {family} step setting(s) {', '.join(unknown)}; known: {', '.join(known)}.")
    if family == "dimuon" and "learning_rate" not in raw:
        raise InvalidRequestError("DimuonParams needs a learning_rate.")
    try:
        return OPTIMIZERS[family](**{key: float(value) for key, value in raw.items()})
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{family} step settings must be numbers.") from None
