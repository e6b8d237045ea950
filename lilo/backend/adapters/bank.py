"""The LoRA bank: every wrapped projection's A and B for every adapter slot, in one tensor.

A ``(slots, D)`` tensor holds every projection's A and B of a slot in one contiguous row, and a gradient tensor is
laid out alike. The layers' parameters are views into those rows, so the optimizer steps k adapters with a few ops
over k rows, and a slot is reset, paged or copied as one row. The projections are a model's attention, MLP and
output linears (``lilo.backend.adapters.lora``) and its fused MoE experts' projections
(``lilo.backend.adapters.experts``: A and B with an expert axis).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from lilo.backend.adapters.experts import (
    MultiLoRAExperts, expert_projections, is_fused_experts, projection_shape, wrap_experts,
)
from lilo.backend.adapters.lora import BATCHED, MultiLoRALinear, Routing, SlotAdapters
from lilo.backend.adapters.slot_memory import slot_zeros
from lilo.backend.families import UNEMBED, Family, family_of, role_of
from lilo.backend.types import LoraSpec


# Per device type, what the bank's rank axis is a multiple of: the grouped GEMMs (the deltas of
# ``lora.MultiLoRALinear`` in packed passes and on CUDA, and of fused experts) take operands whose strides are
# multiples of 16 bytes: 8 bf16 values on CUDA, so there ``--max-rank 4`` gets rows of 8; 4 fp32 values on the CPU,
# so ``--max-rank 5`` gets rows of 8 (the padding stays zero, like an adapter's entries past its own rank).
RANK_MULTIPLE = {"cuda": 8, "cpu": 4}


def bank_rank(max_rank: int, device: torch.device) -> int:
    """The width of the bank's rank axis on ``device``: ``max_rank``, rounded up to ``RANK_MULTIPLE``."""
    multiple = RANK_MULTIPLE.get(device.type, 1)
    return -(-max_rank // multiple) * multiple


class LoraBank:
    """Every wrapped projection's A and B for every slot, one contiguous row per slot, gradients alike.
    ``layers``: per projection path (``<module path>`` of a linear, ``<experts path>.<projection>`` of fused
    experts) its adapters, A and B the parameters ``2 n`` and ``2 n + 1`` of ``view`` in that order."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int, dtype: torch.dtype = torch.float32) -> None:
        self.family = family_of(getattr(model.config, "model_type", ""))
        linears, experts = _targets(model, self.family)
        device = next(model.parameters()).device
        max_rank = bank_rank(max_rank, device)
        shapes = [shape for _, _, linear in linears
                  for shape in ((max_rank, linear.in_features), (linear.out_features, max_rank))]
        for _, _, module in experts:
            for name in expert_projections(module):
                count, fan_in, fan_out = projection_shape(module, name)
                shapes += [(count, max_rank, fan_in), (count, fan_out, max_rank)]
        self.offsets = [0]
        for shape in shapes:
            self.offsets.append(self.offsets[-1] + math.prod(shape))
        self.shapes = shapes
        self.weights = slot_zeros((slots, self.offsets[-1]), dtype, device)
        self.grads = slot_zeros((slots, self.offsets[-1]), dtype, device)
        self.layers: dict[str, SlotAdapters] = {}
        views = (self._views(n) for n in range(len(shapes) // 2))
        for path, parent, linear in linears:
            layer = MultiLoRALinear(linear, *next(views))
            setattr(parent, path.rsplit(".", 1)[-1], layer)
            self.layers[path] = layer
        for path, parent, module in experts:
            wrapped = wrap_experts(module, [next(views) for _ in expert_projections(module)])
            setattr(parent, path.rsplit(".", 1)[-1], wrapped)
            self.layers.update({f"{path}.{name}": projection for name, projection in wrapped.projections.items()})

    def _views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection ``n``'s A, B, and their gradients."""
        a, b = 2 * n, 2 * n + 1
        return (self.view(self.weights, a), self.view(self.weights, b), self.view(self.grads, a),
                self.view(self.grads, b))

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index`` (A and B of each layer in turn) as a (slots, ...) view of a (slots, D) tensor."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return flat[:, start:end].view(flat.shape[0], *self.shapes[index])

    def trained_index(self, index: int, rank: int) -> torch.Tensor:
        """Where, in a slot's row, parameter ``index``'s entries of an adapter of ``rank`` lie: A's first ``rank``
        rows, B's first ``rank`` columns (of every expert, for fused experts)."""
        entries = torch.arange(self.offsets[index], self.offsets[index + 1]).view(self.shapes[index])
        return (entries[..., :rank, :] if index % 2 == 0 else entries[..., :rank]).flatten()

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers.values() for p in (layer.lora_A, layer.lora_B)]

    def uncovered(self, model: nn.Module) -> dict[str, list[str]]:
        """What of ``model``'s decoder layers no adapter of this bank reaches, by LoraConfig target (``attn``: the
        attention's, ``mlp``: the rest of a layer): the names of the weight matrices (and fused expert stacks)
        outside every wrapped projection, less norms and what stays frozen by design (each family's ``frozen`` in
        ``lilo.backend.families``). Empty lists: every projection a target asks for trains."""
        wrapped = [path for path, module in model.named_modules()
                   if isinstance(module, (SlotAdapters, MultiLoRAExperts))]
        layers = _layers_prefix(model)
        found: dict[str, set[str]] = {"attn": set(), "mlp": set()}
        for name, parameter in model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            if (parameter.dim() < 2 or not name.startswith(layers) or role_of(self.family, name) == "frozen"
                    or any(owner == path or owner.startswith(f"{path}.") for path in wrapped)):
                continue
            relative = _in_layer(owner, layers)
            found["attn" if "attn" in relative else "mlp"].add(relative)
        return {target: sorted(names) for target, names in found.items()}

    def projections(self, model: nn.Module) -> dict[str, list[str]]:
        """The projections this bank puts adapters on, by LoraConfig target (``attn``, ``mlp``, ``unembed``): their
        paths within a decoder layer (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``), or within the model
        for those outside the layers (``lm_head``). What ``get_info`` says a model trains."""
        layers = _layers_prefix(model)
        found: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
        for path in self.layers:
            found[self.target_of(path)].add(_in_layer(path, layers) if path.startswith(layers) else path)
        return {target: sorted(names) for target, names in found.items()}

    def target_of(self, path: str) -> str:
        """The LoraConfig target (``attn``, ``mlp``, ``unembed``) that trains the projection at ``path``."""
        return role_of(self.family, path) or "unembed"

    def trains(self, path: str, spec: LoraSpec) -> bool:
        """Whether an adapter of ``spec`` trains the projection at ``path``."""
        target = self.target_of(path)
        return spec.train_attn if target == "attn" else spec.train_mlp if target == "mlp" else spec.train_unembed

    def route(self, slots: Sequence[int] | None, mode: str = BATCHED, lengths: Sequence[int] | None = None) -> None:
        """Route batch rows to slots, the deltas run as ``mode`` says; a layer no routed adapter trains runs as the
        bare base (and stays off the autograd graph). With ``lengths``, the rows are sequences packed end to end
        in one (``Routing.of``)."""
        rows = torch.tensor(list(slots)) if slots is not None else None
        routing = None
        if rows is not None:
            routing = Routing.of(rows, mode, self.weights.device,
                                 torch.tensor(list(lengths)) if lengths is not None else None)
        for layer in self.layers.values():
            active = routing is not None and bool(layer.trained[rows].any())
            layer.routing = routing if active else None


def _layers_prefix(model: nn.Module) -> str:
    """The path prefix of ``model``'s decoder layers (``model.layers.``), wherever its decoder sits."""
    decoder = next(path for path, module in model.named_modules() if module is model.get_decoder())
    return f"{decoder}.layers."


def _in_layer(path: str, layers: str) -> str:
    """A module's path within its decoder layer: past ``layers`` and the layer's index."""
    return path[len(layers):].split(".", 1)[-1]


def _targets(model: nn.Module, family: Family) -> tuple[list[tuple[str, nn.Module, nn.Linear]],
                                                      list[tuple[str, nn.Module, nn.Module]]]:
    """(path, parent module, child) of every linear of ``model`` its ``family`` adapts (and the output head), and of
    every fused experts module."""
    linears, experts = [], []
    layers = _layers_prefix(model)  # the language model's: a vision tower's projections are not adapted
    for path, module in model.named_modules():
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            adapted = child_name == UNEMBED or (child_path.startswith(layers)
                                                and role_of(family, child_path) in ("attn", "mlp"))
            if adapted and isinstance(child, nn.Linear):
                linears.append((child_path, module, child))
            elif is_fused_experts(child) and child_path.startswith(layers):
                experts.append((child_path, module, child))
    return linears, experts
