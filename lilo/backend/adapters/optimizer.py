"""AdamW per adapter slot; the steps of several adapters in one call run as one fused update.

Every adapter's parameters are one row of the ``LoraBank``'s ``(slots, D)`` weights, its gradients the same row of
the gradient tensor, and the optimizer keeps both moments in the same layout. A step for models m1..mk works on
*blocks*: runs of consecutive slots, each a contiguous ``(rows, D)`` view. Per block it takes one norm kernel (each
row's own norm, for its own clipping) and one zeroing; per block of rows that also share hyperparameters (learning
rate, betas, eps, weight decay) and a step count, one call of torch's fused AdamW kernel. Models trained side by
side sit in neighbouring slots and step in lockstep, so k of them usually cost a handful of kernels, not k times
as many: that per-kernel overhead is what one model's step mostly is.
Entries an adapter does not train (rank padding, projections it leaves alone) have zero weights and zero
gradients, so a step leaves them exactly zero.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lilo.backend.adapters.slot_memory import slot_zeros
from lilo.backend.types import AdamParams


class SlotAdamW:
    def __init__(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        self.weights, self.grads = weights, grads
        self.exp_avg = slot_zeros(weights.shape, weights.dtype, weights.device)
        self.exp_avg_sq = slot_zeros(weights.shape, weights.dtype, weights.device)
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
        for first, stop in slot_runs(slots):
            self.grads[first:stop].zero_()

    @torch.no_grad()
    def step(self, slots: Sequence[int], params: Sequence[AdamParams]) -> list[float]:
        """One fused AdamW step for these slots (slot i with ``params[i]``); returns each slot's gradient norm
        before clipping."""
        hyper = dict(zip(slots, params))
        norms = clip_slots(self.grads, slots, [p.grad_clip_norm for p in params])
        for first, stop in slot_runs(slots):
            self.step_counts[first:stop] += 1
        counts = self.step_counts.tolist()
        groups: dict[tuple[AdamParams, float], list[int]] = {}
        for slot, h in hyper.items():
            groups.setdefault((h, counts[slot]), []).append(slot)
        for (h, _), members in groups.items():
            runs = slot_runs(members)
            torch._fused_adamw_(
                [self.weights[a:b] for a, b in runs], [self.grads[a:b] for a, b in runs],
                [self.exp_avg[a:b] for a, b in runs], [self.exp_avg_sq[a:b] for a, b in runs], [],
                [self.step_counts[a] for a, _ in runs], lr=h.learning_rate, beta1=h.beta1, beta2=h.beta2,
                weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        return norms


def clip_slots(grads: torch.Tensor, slots: Sequence[int], clip_norms: Sequence[float]) -> list[float]:
    """Each slot's gradient norm (one norm kernel per run of consecutive slots), its gradients scaled down to its
    clip norm where that is positive and smaller; returns the norms before clipping, in ``slots``' order."""
    limit = dict(zip(slots, clip_norms))
    norms: dict[int, float] = {}
    for first, stop in slot_runs(slots):
        block = grads[first:stop]
        norms.update(zip(range(first, stop), torch.linalg.vector_norm(block, dim=1).tolist()))
        clip = [min(1.0, limit[s] / (norms[s] + 1e-6)) if limit[s] > 0 else 1.0 for s in range(first, stop)]
        if any(c < 1.0 for c in clip):
            block.mul_(torch.tensor(clip, dtype=block.dtype, device=block.device).unsqueeze(1))
    return [norms[slot] for slot in slots]


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """The distinct slots as runs of consecutive ones, ``[(first, stop), ...]`` in ascending order."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs
