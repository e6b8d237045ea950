"""AdamW per adapter slot; the steps of several adapters in one call run as one fused update.

Each adapter owns one slice (its slot) of every LoRA parameter it trains. The optimizer keeps first and second
moments shaped like the parameters, so a slot's state is the same slice of them. A step for models m1..mk gathers
all their slices and runs AdamW with ``torch._foreach_*`` kernels over the whole list, each slice with its own
model's hyperparameters (learning rate, betas, eps, weight decay) and its own step count, after clipping each
model's gradient by its own total norm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


class SlotAdamW:
    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        self.parameters = list(parameters)
        self.exp_avg = [torch.zeros_like(p) for p in self.parameters]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.parameters]
        self.steps: dict[int, int] = {}

    def reset_slot(self, slot: int) -> None:
        """A reused slot starts from zeroed state."""
        with torch.no_grad():
            for m, v in zip(self.exp_avg, self.exp_avg_sq):
                m[slot].zero_()
                v[slot].zero_()
        self.steps[slot] = 0

    def zero_grad(self, slots: Sequence[int]) -> None:
        for p in self.parameters:
            if p.grad is not None:
                p.grad[list(slots)] = 0

    @torch.no_grad()
    def step(self, slots: Sequence[int], params: Sequence[AdamParams],
             trained: Sequence[Sequence[int]] | None = None) -> list[float]:
        """One fused AdamW step for these slots (slot i with ``params[i]``); ``trained[i]`` lists the indices of
        ``self.parameters`` slot i trains (default: all). Returns each slot's gradient norm before clipping."""
        trained = trained or [range(len(self.parameters))] * len(slots)
        p_list, g_list, m_list, v_list, owner = [], [], [], [], []
        for i, (slot, indices) in enumerate(zip(slots, trained)):
            for j in indices:
                p = self.parameters[j]
                if p.grad is None:
                    continue
                p_list.append(p[slot])
                g_list.append(p.grad[slot])
                m_list.append(self.exp_avg[j][slot])
                v_list.append(self.exp_avg_sq[j][slot])
                owner.append(i)
        if not p_list:
            return [0.0] * len(slots)
        norms_per_tensor = torch._foreach_norm(g_list)
        squared = [0.0] * len(slots)
        for i, norm in zip(owner, norms_per_tensor):
            squared[i] += float(norm) ** 2
        grad_norms = [math.sqrt(total) for total in squared]
        clip = [min(1.0, params[i].grad_clip_norm / (grad_norms[i] + 1e-6)) if params[i].grad_clip_norm > 0 else 1.0
                for i in range(len(slots))]
        if any(c < 1.0 for c in clip):
            torch._foreach_mul_(g_list, [clip[i] for i in owner])

        for slot in slots:
            self.steps[slot] = self.steps.get(slot, 0) + 1
        hp = [params[i] for i in owner]
        t = [self.steps[slots[i]] for i in owner]
        torch._foreach_mul_(p_list, [1.0 - h.learning_rate * h.weight_decay for h in hp])
        torch._foreach_mul_(m_list, [h.beta1 for h in hp])
        torch._foreach_add_(m_list, torch._foreach_mul(g_list, [1.0 - h.beta1 for h in hp]))
        torch._foreach_mul_(v_list, [h.beta2 for h in hp])
        torch._foreach_addcmul_(v_list, g_list, g_list, [1.0 - h.beta2 for h in hp])
        denom = torch._foreach_sqrt(v_list)
        torch._foreach_div_(denom, [math.sqrt(1.0 - h.beta2 ** step) for h, step in zip(hp, t)])
        torch._foreach_add_(denom, [h.eps for h in hp])
        torch._foreach_addcdiv_(p_list, m_list, denom,
                                [-h.learning_rate / (1.0 - h.beta1 ** step) for h, step in zip(hp, t)])
        return grad_norms
