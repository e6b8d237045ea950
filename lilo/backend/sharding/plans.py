"""What rank 0 sends a follower for one pass, and the contract of whatever carries it there (``Peers``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from lilo.backend.training.loss_graph import LossGraph
from lilo.backend.types import Datum, LoraSpec, SamplingRequest


@dataclasses.dataclass(frozen=True)
class SlotUpdate:
    """A slot whose adapter changed since the followers last saw it: its spec (which entries of the bank's row it
    trains); its weights follow in the pass's broadcast."""

    slot: int
    spec: LoraSpec


@dataclasses.dataclass(frozen=True)
class TrainRow:
    """One datum of a pass: the slot it is routed to and the loss it takes (``losses.LOSSES`` name and checked
    config). ``request``: which of the pass's requests it belongs to (rank 0's bookkeeping)."""

    request: int
    slot: int
    datum: Datum
    loss_fn: str
    config: dict
    custom_loss: LossGraph | None = None  # loss_fn "custom": the loss it runs


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """One rank's part of a forward(-backward): per micro-batch its rows (maybe none: it still takes part) and
    whether every rank recomputes that micro-batch's layers; then the LoRA gradients of ``grad_slots`` are summed
    into rank 0's."""

    updates: tuple[SlotUpdate, ...]
    chunks: tuple[tuple[tuple[TrainRow, ...], bool], ...]
    forward_only: bool
    grad_slots: tuple[SlotUpdate, ...]


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """One generation, the same on every rank: every request (each with its seed set, so all ranks draw the same
    tokens and stop together) and the slot of each."""

    updates: tuple[SlotUpdate, ...]
    requests: tuple[SamplingRequest, ...]
    slots: tuple[int, ...]


Plan = TrainPlan | SamplePlan


class Peers(Protocol):
    """Rank 0's line to its followers (``cluster.trainer.ranks`` over Ray)."""

    def dispatch(self, plans: Sequence[Plan]) -> Any:
        """Hand plan k to follower k + 1, at once; returns what ``collect`` waits on."""

    def collect(self, pending: Any) -> list[Any]:
        """Each follower's result of the dispatched plans; raises if one failed or died."""

    def failed(self, error: BaseException) -> None:
        """A pass on the group failed part-way: its collectives are out of step, so the group is rebuilt."""
