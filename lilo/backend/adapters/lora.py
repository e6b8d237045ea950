"""Multi-LoRA linear layers: one frozen base projection, many adapters' A and B, one forward for all of them.

Each wrapped projection sees, per adapter *slot*, ``A[slot]: (max_rank, in)`` and ``B[slot]: (out, max_rank)``.
An adapter of rank r < max_rank uses the first r rows of A and columns of B; the rest stay exactly zero (they get
zero gradients, so they never move). Before each execution the engine routes every batch row to a slot; the delta
for row i is ``scale[slot_i] * (x_i @ A[slot_i].T) @ B[slot_i].T``, so rows of different adapters (and ranks)
share one pass over the base weights, and a row's gradients reach only its own adapter's slot.

Three ways to run the deltas (``Routing.mode``): ``batched`` gathers every row's A and B (padded to max_rank) for
one batched GEMM (training on the CPU, where autograd wants one op over all rows); ``grouped`` runs one GEMM per run
of consecutive rows sharing a slot (torch's grouped GEMM, on CUDA); ``runs`` loops over those runs with plain GEMMs
at each adapter's own rank, skipping rows of no adapter (sampling on the CPU, without autograd).

A *packed* pass (``lilo.backend.training.packing``) runs its sequences end to end in one row; its routing then has
a row per token (``Routing.of(..., lengths=)``), so each token's delta comes from its own sequence's adapter, and
the layers see their input as a token a row. There, batched training runs the grouped GEMM (one per run of tokens,
on the CPU too) instead: gathering A and B per token would copy them thousands of times.

All of it lives in one ``LoraBank`` (``lilo.backend.adapters.bank``), which also covers fused MoE experts
(``lilo.backend.adapters.experts``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import nn


# A row routed to this slot runs through the bare base model (its scale is the layers' trailing zero entry).
BASE_SLOT = -1

# Gradients accumulate in place into views of the bank, which are strided like their parameters on purpose; torch
# warns that such a layout may be slower, but the alternative is a copy per parameter per step.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


BATCHED, GROUPED, RUNS = "batched", "grouped", "runs"
# A pass's batched and grouped deltas run at its widest adapter's rank rounded up to this (the grouped GEMM wants
# 16-byte strides: 8 bf16 values), not at max_rank: past an adapter's rank its A and B are zero padding.
RANK_STEP = 8


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which slot every batch row uses during one execution, and the runs of consecutive rows sharing one. Packed:
    a row is a token of the pass's one stream (the module's docstring)."""
    row_slots: torch.Tensor  # (rows,) long
    run_slots: torch.Tensor  # (runs,) long: the slot of each run of equal consecutive rows
    run_ends: torch.Tensor  # (runs,) long: rows up to the end of each run
    runs: tuple[tuple[int, int, int], ...]  # (slot, first row, end row) of each run, on the CPU
    mode: str  # BATCHED, GROUPED or RUNS (the module's docstring)
    packed: bool = False

    @classmethod
    def of(cls, slots: torch.Tensor, mode: str, device: torch.device | str = "cpu",
           lengths: torch.Tensor | None = None) -> Routing:
        """From the rows' slots as a CPU tensor; with ``lengths`` (each row's tokens), packed: a row per token."""
        listed = slots.tolist()
        ends = [i + 1 for i in range(len(listed)) if i + 1 == len(listed) or listed[i + 1] != listed[i]]
        run_slots = [listed[end - 1] for end in ends]
        if lengths is not None:
            slots = slots.repeat_interleave(lengths)
            token_ends = [0, *lengths.cumsum(0).tolist()]
            ends = [token_ends[end] for end in ends]
        runs = tuple(zip(run_slots, [0] + ends[:-1], ends))
        return cls(slots.to(device), torch.tensor(run_slots, device=device), torch.tensor(ends, device=device),
                   runs, mode, lengths is not None)

    def window(self, start: int, end: int) -> Routing:
        """A packed routing's tokens ``start`` to ``end``, as a routing of their own."""
        runs = tuple((slot, max(first, start) - start, min(last, end) - start) for slot, first, last in self.runs
                     if first < end and last > start)
        device = self.row_slots.device
        return Routing(self.row_slots[start:end], torch.tensor([slot for slot, _, _ in runs], device=device),
                       torch.tensor([last for _, _, last in runs], device=device), runs, self.mode, True)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous: the grouped GEMM's backward wants strides of
    whole 16 bytes, and a consumer that transposes the output (Qwen3.5's convolution over in_proj_qkv's) sends back
    a gradient strided by the token count."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class SlotAdapters(nn.Module):
    """Every slot's A and B of one projection, and what routing knows of them: the bookkeeping a linear's and an
    expert projection's multi-LoRA layers share. ``lora_A`` is ``(slots, ..., max_rank, in_features)`` and
    ``lora_B`` ``(slots, ..., out_features, max_rank)`` (the ``...`` an expert axis for fused experts)."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, grad_A: torch.Tensor, grad_B: torch.Tensor,
                 in_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        # Views into the bank; autograd accumulates into the preset .grad views in place, so the bank's gradient
        # rows fill up without any copy.
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)
        self.lora_A.grad, self.lora_B.grad = grad_A, grad_B
        slots = lora_A.shape[0]
        self.register_buffer("scale", torch.zeros(slots + 1, dtype=lora_A.dtype, device=lora_A.device),
                             persistent=False)
        # Which slots train this projection, at which rank (0: none) and scale, on the CPU: routing asks them per
        # execution without a device sync. The trailing entry is BASE_SLOT's, never trained.
        self.trained = torch.zeros(slots + 1, dtype=torch.bool)
        self.ranks = [0] * (slots + 1)
        self.scales = [0.0] * (slots + 1)
        self.routing: Routing | None = None  # None: every row through the bare base

    def used_rank(self, routing: Routing) -> int:
        """How much of A's rows and B's columns a pass of ``routing`` needs: its widest adapter's rank here, rounded
        up to ``RANK_STEP`` within max_rank (the rest is zero for every slot it routes to, so the delta is exact)."""
        widest = max((self.ranks[slot] for slot, _, _ in routing.runs), default=0)
        return min(self.lora_A.shape[-2], max(RANK_STEP, -(-widest // RANK_STEP) * RANK_STEP))

    def set_adapter(self, slot: int, rank: int, scale: float) -> None:
        """What routing knows of the adapter in ``slot``: its rank here (0: it does not train this projection) and
        the scale of its delta."""
        scale = scale if rank else 0.0
        self.scale[slot] = scale
        self.scales[slot] = scale
        self.ranks[slot] = rank
        self.trained[slot] = rank > 0

    def reset_slot(self, slot: int, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        """A fresh adapter in ``slot``: A like nn.Linear's init on its first ``rank`` rows (of every expert), B
        zero, padding zero."""
        with torch.no_grad():
            self.lora_A[slot].zero_()
            self.lora_B[slot].zero_()
            bound = 1.0 / math.sqrt(self.in_features)
            trained = self.lora_A[slot, ..., :rank, :]
            a = torch.empty(trained.shape, dtype=self.lora_A.dtype)
            a.uniform_(-bound, bound, generator=generator)
            trained.copy_(a.to(self.lora_A.device))
        self.set_adapter(slot, rank, alpha / rank)

    def clear_slot(self, slot: int) -> None:
        with torch.no_grad():
            self.lora_A[slot].zero_()
            self.lora_B[slot].zero_()
        self.set_adapter(slot, 0, 0.0)


class MultiLoRALinear(SlotAdapters):
    def __init__(self, base: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor, grad_A: torch.Tensor,
                 grad_B: torch.Tensor) -> None:
        super().__init__(lora_A, lora_B, grad_A, grad_B, base.in_features)
        self.base = base
        for parameter in self.base.parameters():
            parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.routing
        if routing is None:
            return self.base(x)
        if x.dim() != 3 or routing.packed:
            # As (rows, positions, in): (rows, ..., in) as multi-head latent attention's kv_b_proj sees its latents,
            # (rows x positions, in) as Qwen3.5-MoE's shared expert sees them; packed, a token a row.
            return self.forward_rows(x.reshape(len(routing.row_slots), -1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return self.forward_rows(x)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The output for ``x`` of (rows, positions, in), each row's delta from its routed slot."""
        routing = self.routing
        out = self.base(x)
        if routing.mode == GROUPED or (routing.packed and routing.mode == BATCHED):
            return out + self._grouped_delta(x, routing)
        if routing.mode == RUNS:
            return self._add_runs(out, x, routing)
        slots, rank = routing.row_slots, self.used_rank(routing)
        a = self.lora_A[:, :rank][slots].to(x.dtype)  # (rows, r, in)
        b = self.lora_B[:, :, :rank][slots].to(x.dtype)  # (rows, out, r)
        # Scaling the rank-r intermediate, not the output, and adding in the GEMM keep this at two passes over x.
        h = torch.bmm(x, a.transpose(1, 2)) * self.scale[slots].to(x.dtype).view(-1, 1, 1)
        return torch.baddbmm(out, h, b.transpose(1, 2))

    def _add_runs(self, out: torch.Tensor, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``out`` plus each run's delta, in place: two GEMMs per run at its adapter's own rank (A's first rows, B's
        first columns: strided views, no copies), none for rows of no adapter (rank 0 here)."""
        width = out.shape[-1]
        for slot, start, end in routing.runs:
            rank = self.ranks[slot]
            if not rank:
                continue
            a = self.lora_A[slot, :rank].to(x.dtype)  # (r, in)
            b = self.lora_B[slot, :, :rank].to(x.dtype)  # (out, r)
            h = x[start:end].reshape(-1, x.shape[-1]) @ a.T
            out[start:end].view(-1, width).addmm_(h, b.T, alpha=self.scales[slot])
        return out

    def _grouped_delta(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """One GEMM per run of rows sharing a slot (torch's grouped GEMM): no per-row copies of A and B."""
        rows, width = x.shape[0], x.shape[1]
        offsets = (routing.run_ends * width).to(torch.int32)
        rank = self.used_rank(routing)
        a = self.lora_A[:, :rank][routing.run_slots].to(x.dtype).transpose(1, 2)  # (runs, in, r)
        b = self.lora_B[:, :, :rank][routing.run_slots].to(x.dtype).transpose(1, 2)  # (runs, r, out)
        h = torch._grouped_mm(x.reshape(rows * width, -1), a, offs=offsets).view(rows, width, -1)
        h = h * self.scale[routing.row_slots].to(x.dtype).view(-1, 1, 1)
        delta = torch._grouped_mm(h.reshape(rows * width, -1), b, offs=offsets).view(rows, width, -1)
        return _ContiguousGrad.apply(delta)
