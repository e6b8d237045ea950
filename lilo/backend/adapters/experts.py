"""Multi-LoRA on fused MoE experts: per adapter slot and per expert, an A and B on each expert projection.

transformers keeps a mixture-of-experts block's experts as 3-D parameters, one module for all of them
(``Qwen3MoeExperts.gate_up_proj: (experts, 2 x inter, hidden)``, ``down_proj: (experts, hidden, inter)``; GPT-OSS
stores them transposed, with biases), every family's marked by the same decorator (``use_experts_implementation``:
``is_transposed``, ``has_bias``, ``has_gate``, ``_apply_gate``). ``MultiLoRAExperts`` takes such a module's place
and runs its experts as transformers' eager loop does, one expert at a time over the tokens routed to it, adding to
each token the delta of its own row's adapter for that expert: ``scale[slot] * (x @ A[slot, e].T) @ B[slot, e].T``
on the gate/up projection's output (before the gate) and on the down projection's. So rows of different adapters
(and ranks) share one pass over the experts, the router stays frozen (its weights are not wrapped), and a row's
gradients reach only its own adapter's slot, for the experts its tokens were routed to.

Each (expert, slot) pair is one pair of GEMMs over that expert's tokens of that slot's rows (found from the
routing's runs of rows, on the CPU: no device sync); a slot not training a projection (rank 0) adds nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lilo.backend.adapters.lora import Routing, SlotAdapters


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

    def delta(self, x: torch.Tensor, tokens: torch.Tensor, expert: int, routing: Routing,
              tokens_per_row: int) -> torch.Tensor | None:
        """The adapters' delta on this projection's output for ``x``, the inputs of ``tokens`` (indices into the
        flattened batch) routed to ``expert``; None when no adapter of theirs trains it."""
        delta = None
        for slot, first_row, end_row in routing.runs:
            rank = self.ranks[slot]
            if not rank:
                continue
            rows = ((tokens >= first_row * tokens_per_row) & (tokens < end_row * tokens_per_row)).nonzero().squeeze(1)
            if not len(rows):
                continue
            a = self.lora_A[slot, expert, :rank].to(x.dtype)  # (r, in)
            b = self.lora_B[slot, expert, :, :rank].to(x.dtype)  # (out, r)
            part = (x[rows] @ a.T) @ b.T * self.scales[slot]
            if delta is None:
                delta = x.new_zeros(x.shape[0], b.shape[0])
            delta = delta.index_add(0, rows, part)
        return delta


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
        tokens_per_row = hidden_states.shape[0] // len(routing.row_slots)
        base = self.base
        first, down = expert_projections(base)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # (experts + 1) classes: a family may mark a token's unused choice with num_experts.
            hits = nn.functional.one_hot(top_k_index, num_classes=base.num_experts + 1).permute(2, 1, 0)
            experts = [int(e) for e in torch.greater(hits.sum(dim=(-1, -2)), 0).nonzero()[:, 0]
                       if int(e) < base.num_experts]
        for expert in experts:
            choice, tokens = torch.where(hits[expert])
            x = hidden_states[tokens]
            h = self._project(first, x, tokens, expert, routing, tokens_per_row)
            h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
            y = self._project(down, h, tokens, expert, routing, tokens_per_row)
            y = y * top_k_weights[tokens, choice, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _project(self, name: str, x: torch.Tensor, tokens: torch.Tensor, expert: int, routing: Routing,
                 tokens_per_row: int) -> torch.Tensor:
        base = self.base
        weight = getattr(base, name)[expert]
        y = x @ weight if base.is_transposed else x @ weight.T
        if base.has_bias:
            y = y + getattr(base, f"{name}_bias")[expert]
        delta = self.projections[name].delta(x, tokens, expert, routing, tokens_per_row)
        return y if delta is None else y + delta


def wrap_experts(experts: nn.Module, views: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> MultiLoRAExperts:
    """``experts`` with adapters on each projection (``expert_projections`` order), from the bank's views
    (A, B, grad A, grad B) of each."""
    projections = {name: ExpertProjection(*view, in_features=projection_shape(experts, name)[1])
                   for name, view in zip(expert_projections(experts), views)}
    return MultiLoRAExperts(experts, projections)
