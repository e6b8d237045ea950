"""What the engine runs: commands, each of one kind (the backend it drives them through is ``contract``)."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Generic, Hashable, TypeVar

from lilo.tenants import LOCAL_TENANT


class Kind(StrEnum):
    """What a request asks for. A member equals its string, which is what the futures DB stores (its
    ``kind`` column) and what the wire and the telemetry phases say."""

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
    CREATE_CUSTOM_LOSS = "create_custom_loss"


# Kinds whose commands of several models may share one backend execution.
COALESCING_KINDS = frozenset({Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.OPTIM_STEP, Kind.SAMPLE})
# Kinds split into a capture (on the compute lane) and a persist (on the persist lane).
SAVING_KINDS = frozenset({Kind.SAVE_WEIGHTS, Kind.SAVE_WEIGHTS_FOR_SAMPLER, Kind.SAVE_WEIGHTS_EXTERNAL})


# A command's payload, by its kind: TrainInput (forward, forward_backward), AdamParams (optim_step), SamplingRequest
# (sample), SaveRequest (the saves), LoadRequest (load_weights; a restore from a page file: the backend's
# PageRestore, which only a trainer builds), the refusal's message (refused).
Payload = TypeVar("Payload")


@dataclasses.dataclass(frozen=True)
class Command(Generic[Payload]):
    """One request for one model, in its model's seq order."""

    model_id: str
    seq_id: int
    kind: Kind
    request_id: str
    payload: Payload
    fingerprint: str = ""
    # forward/forward_backward: which commands may share a batch (loss_fn and its config); tokens count against
    # the batch's token budget.
    batch_key: Hashable = ()
    tokens: int = 0
    # Whose it is, and that tenant's share of a trainer whose passes cannot hold every ready command (the tenants
    # file's weight, as the futures DB said when it recorded the command): the scheduler's fair share.
    tenant: str = LOCAL_TENANT
    weight: float = 1.0
    # Its request's trace context, from the ingress (``lilo.timing.traces.carrier``); None when traces are off.
    trace: tuple[tuple[str, str], ...] | None = None

    @property
    def coalesce_key(self) -> tuple:
        return (self.kind, self.batch_key)
