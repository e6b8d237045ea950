"""A follower rank: runs rank 0's plans on its shard of the base model, with a mirror of the LoRA bank."""

from __future__ import annotations

from typing import Any

import torch

from lilo.backend import sampling
from lilo.backend.sharding.exchange import broadcast_slots, sum_gradients
from lilo.backend.sharding.plans import Plan, SlotUpdate, TrainPlan

RowResult = tuple[torch.Tensor, torch.Tensor, float]


class Follower:
    def __init__(self, backend: Any) -> None:
        self.backend = backend  # a TorchBackend on the sharded base; only its bank, layers and passes are used

    def run(self, plan: Plan) -> list[list[RowResult]] | None:
        """Take part in one pass: for a ``TrainPlan``, each micro-batch's rows' (logprobs, per-token loss, loss
        sum) on the CPU; for a ``SamplePlan`` nothing (rank 0 answers the samples)."""
        backend = self.backend
        self._apply(plan.updates)
        if not isinstance(plan, TrainPlan):
            sampling.generate(backend.model, backend._route_sampling, list(plan.requests), list(plan.slots),
                              backend.decode, backend.images)
            return None
        if not plan.forward_only:
            for slot in plan.grad_slots:
                backend.bank.grads[slot.slot].zero_()
        results = [[(logprobs.cpu(), None if elementwise is None else elementwise.cpu(), loss, metrics)
                    for logprobs, elementwise, loss, metrics in backend._rows_pass(rows, plan.forward_only, recompute)]
                   for rows, recompute in plan.chunks]
        if not plan.forward_only:
            sum_gradients(backend.bank.grads, plan.grad_slots, backend._entry_index)
        return results

    def _apply(self, updates: tuple[SlotUpdate, ...]) -> None:
        broadcast_slots(self.backend.bank.weights, updates, self.backend._entry_index)
        for update in updates:
            self.backend.set_slot_spec(update.slot, update.spec)
