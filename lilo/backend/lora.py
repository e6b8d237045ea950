"""Multi-LoRA linear layers: one frozen base projection, many adapters' A and B, one forward for all of them.

Each wrapped projection holds, per adapter *slot*, ``A[slot]: (max_rank, in)`` and ``B[slot]: (out, max_rank)``.
An adapter of rank r < max_rank uses the first r rows of A and columns of B; the rest stay exactly zero (they get
zero gradients, so they never move). Before each execution the engine says which slot each batch row belongs to;
the delta for row i is ``scale[slot_i] * (x_i @ A[slot_i].T) @ B[slot_i].T``, so rows of different adapters (and
ranks) share one pass over the base weights, and a row's gradients reach only its own adapter's slot.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNEMBED = "lm_head"


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        for parameter in self.base.parameters():
            parameter.requires_grad_(False)
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(slots, max_rank, base.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(slots, base.out_features, max_rank, dtype=dtype, device=device))
        self.register_buffer("scale", torch.zeros(slots, dtype=dtype, device=device), persistent=False)
        # Slot of each batch row for the current execution; None: the bare base model.
        self.row_slots: torch.Tensor | None = None

    def reset_slot(self, slot: int, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        """A fresh adapter in ``slot``: A like nn.Linear's init on its first ``rank`` rows, B zero, padding zero."""
        with torch.no_grad():
            self.lora_A[slot].zero_()
            self.lora_B[slot].zero_()
            bound = 1.0 / math.sqrt(self.base.in_features)
            a = torch.empty(rank, self.base.in_features, dtype=self.lora_A.dtype)
            a.uniform_(-bound, bound, generator=generator)
            self.lora_A[slot, :rank] = a.to(self.lora_A.device)
            self.scale[slot] = alpha / rank

    def clear_slot(self, slot: int) -> None:
        with torch.no_grad():
            self.lora_A[slot].zero_()
            self.lora_B[slot].zero_()
            self.scale[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.row_slots is None:
            return out
        slots = self.row_slots
        a = self.lora_A[slots]  # (rows, r, in)
        b = self.lora_B[slots]  # (rows, out, r)
        delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
        return out + delta * self.scale[slots].view(-1, 1, 1)


def target_names(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    return ((ATTENTION_PROJECTIONS if train_attn else ()) + (MLP_PROJECTIONS if train_mlp else ())
            + ((UNEMBED,) if train_unembed else ()))


def attach_multi_lora(model: nn.Module, slots: int, max_rank: int) -> dict[str, MultiLoRALinear]:
    """Wrap every attention, MLP and output projection of ``model`` in place; returns them by module path."""
    wrapped: dict[str, MultiLoRALinear] = {}
    names = set(ATTENTION_PROJECTIONS + MLP_PROJECTIONS + (UNEMBED,))
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in names and isinstance(child, nn.Linear):
                layer = MultiLoRALinear(child, slots, max_rank)
                setattr(module, child_name, layer)
                wrapped[f"{path}.{child_name}" if path else child_name] = layer
    return wrapped


def projection_kind(path: str) -> str:
    return path.rsplit(".", 1)[-1]
