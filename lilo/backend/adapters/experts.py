"""Multi-LoRA on fused MoE experts: per adapter slot and per expert, an A and B on each expert projection.

transformers keeps a mixture-of-experts block's experts as 3-D parameters, one module for all of them
(``Qwen3MoeExperts.gate_up_proj: (experts, 2 x inter, hidden)``, ``down_proj: (experts, hidden, inter)``; GPT-OSS
stores them transposed, with biases), every family's marked by the same decorator (``use_experts_implementation``:
``is_transposed``, ``has_bias``, ``has_gate``, ``_apply_gate``). ``MultiLoRAExperts`` takes such a module's place
and adds to each routed token, on the gate/up projection's output (before the gate) and on the down projection's,
the delta of its own row's adapter for the expert it went to: ``scale[slot] * (x @ A[slot, e].T) @ B[slot, e].T``.
So rows of different adapters (and ranks) share one pass over the experts, the router stays frozen (its weights are
not wrapped), and a row's gradients reach only its own adapter's slot, for the experts its tokens were routed to.

Every routed (token, choice) is sorted by (expert, slot), and each projection is one grouped GEMM over the experts
for the base weights and two over the (expert, slot) groups for the deltas (torch's ``grouped_mm``, a grouped GEMM
kernel on CUDA), with no device sync and no loop in Python. On the CPU the same op beats transformers' eager loop
with a pair of GEMMs per (expert, slot) by 1.3x to 2.5x a pass, training and sampling alike (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn

from lilo.backend.adapters.lora import SlotAdapters


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture-of-experts block's experts as 3-D parameters (transformers' fused layout)."""
    return (hasattr(module, "is_transposed") and hasattr(module, "has_gate")
            and isinstance(getattr(module, "down_proj", None), nn.Parameter) and module.down_proj.dim() == 3)


# Fused projections by the order they run in (and PEFT nests their wrappers: lilo.backend.checkpoints.state).
EXPERT_ORDER = ("gate_up_proj", "up_proj", "down_proj")


def expert_projections(experts: nn.Module) -> tuple[str, ...]:
    """The names of ``experts``' projections, in the order they run: gate/up (or up alone), then down."""
    return ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")


def projection_shape(experts: nn.Module, name: str) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of one fused projection (stored as (E, out, in), or (E, in, out) when
    transposed)."""
    count, first, second = getattr(experts, name).shape
    return (count, first, second) if experts.is_transposed else (count, second, first)


class ExpertProjection(SlotAdapters):
    """One fused projection's adapters: ``lora_A (slots, experts, max_rank, in)``, ``lora_B (slots, experts, out,
    max_rank)``."""


class MultiLoRAExperts(nn.Module):
    """A fused experts module with every slot's adapters on its projections (the module's docstring)."""

    def __init__(self, base: nn.Module, projections: dict[str, ExpertProjection]) -> None:
        super().__init__()
        self.base = base
        for parameter in self.base.parameters():
            parameter.requires_grad_(False)
        self.projections = nn.ModuleDict(projections)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = next((p.routing for p in self.projections.values() if p.routing is not None), None)
        if routing is None:  # no routed adapter trains these experts: the family's own implementation
            return self.base(hidden_states, top_k_index, top_k_weights)
        # The experts as grouped GEMMs over every routed token at once, sorted by (expert, slot).
        base = self.base
        count, (tokens, k) = base.num_experts, top_k_index.shape
        slots = sorted({slot for slot, _, _ in routing.runs})
        # Each row's slot as its index among ``slots`` (from the runs, on the CPU), then each token's.
        row_group = torch.empty(len(routing.row_slots), dtype=torch.long)
        for slot, first_row, end_row in routing.runs:
            row_group[first_row:end_row] = slots.index(slot)
        per_row = tokens // len(routing.row_slots)
        token_group = row_group.to(hidden_states.device).repeat_interleave(per_row)
        token_slot = routing.row_slots.repeat_interleave(per_row)
        # A choice marked unused (expert index num_experts) runs through the last expert with weight zero: dropping
        # it would need a sync.
        expert = top_k_index.reshape(-1)
        weight = top_k_weights.reshape(-1) * (expert < count)
        expert = expert.clamp(max=count - 1)
        token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
        group = expert * len(slots) + token_group[token]
        order = torch.argsort(group, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        groups = Groups(
            experts=torch.bincount(expert, minlength=count).cumsum(0).to(torch.int32), expert=expert,
            slots=torch.bincount(group[order], minlength=count * len(slots)).cumsum(0).to(torch.int32),
            slot=token_slot[token], slot_ids=torch.tensor(slots, device=hidden_states.device), slot_list=tuple(slots))
        first, down = expert_projections(base)
        h = self._project(first, hidden_states[token], groups)
        h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
        y = self._project(down, h, groups) * weight[:, None].to(h.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))

    def _project(self, name: str, x: torch.Tensor, groups: "Groups") -> torch.Tensor:
        """One fused projection of tokens sorted by (expert, slot): a grouped GEMM over the experts, and the deltas'
        two over the (expert, slot) groups (A and B at max_rank; an adapter's padding is zero)."""
        base, projection = self.base, self.projections[name]
        weight = getattr(base, name)
        weight = weight if base.is_transposed else weight.transpose(1, 2)  # (E, in, out)
        y = nn.functional.grouped_mm(x, weight.to(x.dtype), offs=groups.experts)
        if base.has_bias:
            y = y + getattr(base, f"{name}_bias")[groups.expert].to(y.dtype)
        if not any(projection.ranks[slot] for slot in groups.slot_list):
            return y
        # (slots, E, ...) to expert-major groups (E * slots, ...), as the tokens are sorted.
        a = projection.lora_A[groups.slot_ids].transpose(0, 1).flatten(0, 1).to(x.dtype)  # (G, r, in)
        b = projection.lora_B[groups.slot_ids].transpose(0, 1).flatten(0, 1).to(x.dtype)  # (G, out, r)
        h = nn.functional.grouped_mm(x, a.transpose(1, 2), offs=groups.slots)
        h = h * projection.scale[groups.slot].to(x.dtype)[:, None]
        return y + nn.functional.grouped_mm(h, b.transpose(1, 2), offs=groups.slots)


@dataclasses.dataclass(frozen=True)
class Groups:
    """Routed tokens sorted by (expert, slot): the end offsets of each expert's tokens and of each (expert, slot)
    group's, each token's expert and slot, and the slots in group order (the grouped GEMMs' arguments)."""
    experts: torch.Tensor
    expert: torch.Tensor
    slots: torch.Tensor
    slot: torch.Tensor
    slot_ids: torch.Tensor
    slot_list: tuple[int, ...]  # slot_ids on the CPU


def wrap_experts(experts: nn.Module, views: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> MultiLoRAExperts:
    """``experts`` with adapters on each projection (``expert_projections`` order), from the bank's views
    (A, B, grad A, grad B) of each."""
    projections = {name: ExpertProjection(*view, in_features=projection_shape(experts, name)[1])
                   for name, view in zip(expert_projections(experts), views)}
    return MultiLoRAExperts(experts, projections)
