"""What the engine runs: commands, and the small protocol it drives a backend through."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any, Hashable, Protocol, Sequence

class Kind(StrEnum):
    """What a request asks for. A member equals its string, which is what the futures DB stores (its
    ``request_type`` column) and what the wire and the telemetry phases say."""

    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAMPLE = "sample"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    LOAD_WEIGHTS = "load_weights"
    # A request the API refused for bad input after the client had spent its seq_id on it (the tinker SDK spends one
    # on every call): it holds that seq's place in the model's order, so the model's next request does not wait for
    # it forever. Its payload is the refusal's message, and running it fails its future with that message.
    REFUSED = "refused"
    # Lifecycle requests: futures like the others, but never queued as commands.
    CREATE_MODEL = "create_model"
    UNLOAD_MODEL = "unload_model"


# Kinds whose commands of several models may share one backend execution.
COALESCING_KINDS = frozenset({Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.OPTIM_STEP, Kind.SAMPLE})
# Kinds split into a capture (on the compute lane) and a persist (on the persist lane).
SAVING_KINDS = frozenset({Kind.SAVE_WEIGHTS, Kind.SAVE_WEIGHTS_FOR_SAMPLER, Kind.SAVE_WEIGHTS_EXTERNAL})


@dataclasses.dataclass(frozen=True)
class Command:
    """One request for one model, in its model's seq order."""

    model_id: str
    seq_id: int
    kind: Kind
    request_id: str
    payload: Any = None
    fingerprint: str = ""
    # forward/forward_backward: which commands may share a batch (loss_fn and its config); tokens count against
    # the batch's token budget.
    batch_key: Hashable = ()
    tokens: int = 0

    @property
    def coalesce_key(self) -> tuple:
        return (self.kind, self.batch_key)


class Backend(Protocol):
    """The engine's only view of the model code. Batch methods return one entry per command, in order: its result,
    or the exception that failed it alone."""

    def add_adapter(self, model_id: str, spec: Any) -> None: ...

    def remove_adapter(self, model_id: str) -> None: ...

    def forward_backward(self, commands: Sequence[Command], forward_only: bool) -> list[Any]: ...

    def optim_step(self, commands: Sequence[Command]) -> list[Any]: ...

    def sample(self, commands: Sequence[Command]) -> list[Any]: ...

    def load_weights(self, command: Command) -> Any: ...

    def capture(self, command: Command) -> Any: ...

    def persist(self, command: Command, captured: Any) -> Any: ...
