"""Where checkpoints live and how clients name them, without torch (the API front needs these too).

A checkpoint is ``tinker://<run>/{weights|sampler_weights|external_weights}/<name>`` to clients and
``<root>/<run>/{weights|sampler_weights|external_weights}/<name>/`` on disk. Names are plain file names; nothing a
client sends can point outside the checkpoint directory.
"""

from __future__ import annotations

import re
from pathlib import Path

from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError

STATE_FILE, META_FILE = "state.safetensors", "meta.json"
TINKER_SCHEME = "tinker://"
# save_weights_external writes the same PEFT directory as save_weights_for_sampler, for download (signed URLs).
KIND_DIRECTORIES = {Kind.SAVE_WEIGHTS: "weights", Kind.SAVE_WEIGHTS_FOR_SAMPLER: "sampler_weights",
                    Kind.SAVE_WEIGHTS_EXTERNAL: "external_weights"}
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Sampler checkpoints that save_weights_and_get_sampling_client makes are named by the server with this prefix.
EPHEMERAL_PREFIX = "ephemeral-"


def checked_name(name: str) -> str:
    if not NAME_PATTERN.match(name or "") or ".." in name:
        raise InvalidRequestError(
            f"Checkpoint name {name!r} is not allowed; use letters, digits, '.', '_' and '-' (at most 128), "
            "starting with a letter or digit.")
    return name


# The one sampler checkpoint of a training model that its inflight saves (kind "inflight") write again and again:
# every inflight sampling session of the model samples it, so each save updates them all.
INFLIGHT_NAME = f"{EPHEMERAL_PREFIX}inflight"


def ephemeral_name(seq_id: int) -> str:
    """The name of the sampler checkpoint an unnamed snapshot ``save_weights_for_sampler`` at ``seq_id`` writes."""
    return f"{EPHEMERAL_PREFIX}{seq_id}"


def checked_client_name(name: str, kind: Kind) -> str:
    """A checkpoint name a client chose: allowed as a file name, and not one the server names its own sampler
    checkpoints with (saving under it would overwrite one that a sampling session may be reading)."""
    checked_name(name)
    if kind == Kind.SAVE_WEIGHTS_FOR_SAMPLER and name.startswith(EPHEMERAL_PREFIX):
        raise InvalidRequestError(
            f"Sampler checkpoint names starting with {EPHEMERAL_PREFIX!r} are reserved for the checkpoints of "
            f"save_weights_and_get_sampling_client; choose another name than {name!r}.")
    return name


def tinker_path(model_id: str, kind: Kind, name: str) -> str:
    """``tinker://<model_id>/{weights|sampler_weights|external_weights}/<name>``: how clients name a checkpoint."""
    return f"{TINKER_SCHEME}{model_id}/{KIND_DIRECTORIES[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``(run, kind directory, name)`` of a ``tinker://`` checkpoint path; anything that could leave the
    checkpoint directory is refused."""
    if not path.startswith(TINKER_SCHEME):
        raise InvalidRequestError(f"Checkpoint path {path!r} is not a tinker:// path; pass one save_weights returned.")
    parts = path[len(TINKER_SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KIND_DIRECTORIES.values() or parts[0] in ("", ".", ".."):
        raise InvalidRequestError(f"Checkpoint path {path!r} is not of the form tinker://<run>/weights/<name>.")
    return parts[0], parts[1], checked_name(parts[2])


def sampler_run(path: str) -> str:
    """The training run (model id) that saved the sampler checkpoint ``path``; other paths are refused."""
    run, kind, _ = parse_tinker_path(path)
    if kind != KIND_DIRECTORIES[Kind.SAVE_WEIGHTS_FOR_SAMPLER]:
        raise InvalidRequestError(
            f"{path!r} is not a sampler checkpoint; sample from a path save_weights_for_sampler returned "
            "(tinker://<run>/sampler_weights/<name>).")
    return run


def local_directory(root: Path, path: str) -> Path:
    """Where a ``tinker://`` checkpoint lives under ``root``."""
    run, kind, name = parse_tinker_path(path)
    return root / run / kind / name
