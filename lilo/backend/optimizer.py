"""AdamW per adapter slot; the steps of several adapters in one call run as one fused update.

Every adapter's parameters are one row of the ``LoraBank``'s ``(slots, D)`` weights, its gradients the same row of
the gradient tensor, and the optimizer keeps both moments in the same layout. A step for models m1..mk is one norm
kernel over their k rows and one call of torch's fused AdamW kernel per distinct set of hyperparameters (learning
rate, betas, eps, weight decay), each row with its own step count, after clipping each model's gradient by its own
total norm.
Entries an adapter does not train (rank padding, projections it leaves alone) have zero weights and zero
gradients, so a step leaves them exactly zero.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lilo.backend.types import AdamParams


class SlotAdamW:
    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        self.weights, self.grads = weights, grads
        self.exp_avg = torch.zeros_like(weights)
        self.exp_avg_sq = torch.zeros_like(weights)
        # One step counter per slot, as a tensor: the fused kernel reads each row's own count.
        self.step_counts = torch.zeros(weights.shape[0], dtype=torch.float32, device=weights.device)

    def reset_slot(self, slot: int) -> None:
        """A reused slot starts from zeroed state."""
        self.exp_avg[slot].zero_()
        self.exp_avg_sq[slot].zero_()
        self.grads[slot].zero_()
        self.step_counts[slot] = 0

    def steps(self, slot: int) -> int:
        return int(self.step_counts[slot])

    def set_steps(self, slot: int, steps: int) -> None:
        self.step_counts[slot] = steps

    def zero_grad(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.grads[slot].zero_()

    @torch.no_grad()
    def step(self, slots: Sequence[int], params: Sequence[AdamParams]) -> list[float]:
        """One fused AdamW step for these slots (slot i with ``params[i]``); returns each slot's gradient norm
        before clipping. Slots sharing hyperparameters go through one call of torch's fused AdamW kernel (one
        pass over their rows); each row keeps its own step count."""
        grads = [self.grads[slot] for slot in slots]
        norms = torch.stack(torch._foreach_norm(grads)).tolist()
        clip = [min(1.0, h.grad_clip_norm / (norm + 1e-6)) if h.grad_clip_norm > 0 else 1.0
                for h, norm in zip(params, norms)]
        if any(c < 1.0 for c in clip):
            torch._foreach_mul_(grads, clip)
        self.step_counts[list(slots)] += 1
        groups: dict[AdamParams, list[int]] = {}
        for slot, h in zip(slots, params):
            groups.setdefault(h, []).append(slot)
        for h, members in groups.items():
            torch._fused_adamw_(
                [self.weights[s] for s in members], [self.grads[s] for s in members],
                [self.exp_avg[s] for s in members], [self.exp_avg_sq[s] for s in members], [],
                [self.step_counts[s] for s in members], lr=h.learning_rate, beta1=h.beta1, beta2=h.beta2,
                weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        return norms
