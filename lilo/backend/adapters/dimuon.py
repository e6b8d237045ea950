"""Dimuon per adapter slot (the SDK's ``DimuonOptimizerConfig`` / ``DimuonParams``), in the bank's slot layout.

Tinker's documentation says what each setting means, not the whole rule; this is the rule lilo uses, on each of an
adapter's LoRA matrices (A, rank x in; B, out x rank; each expert's own, for fused experts), with its gradient G:

1. The adapter's gradients are clipped to ``grad_clip_norm`` (its global norm over all its matrices; <= 0: none).
2. Momentum: ``M = beta1 * M + (1 - beta1) * G`` (kept where AdamW keeps its first moment, so save_state and
   load_state carry it).
3. A diagonal two-sided preconditioner (the "Di"): ``P = M / ((r + d) ** (1/4) (c + d) ** (1/4))``, ``r`` and ``c``
   each row's and column's mean of ``M ** 2``, smoothed by ``d = DAMPING * mean(M ** 2)``.
4. The matrix sign of P by NS_STEPS Newton-Schulz iterations on P normalized to unit Frobenius norm: an
   orthogonalized direction whose singular values are close to 1, so of Frobenius norm close to sqrt(rank).
5. ``W -= learning_rate * (32 / rank) ** RANK_LR_EXPONENT * sign(P)``: the learning rate applies to a direction of
   norm sqrt(rank), as Tinker's docs say; the rank correction relative to rank 32 is off (exponent 0) until the SDK
   can send one.

Adapters of the same rank step together: each matrix of all of them as one batched computation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lilo.backend.adapters.bank import LoraBank
from lilo.backend.adapters.optimizer import SlotAdamW, clip_slots
from lilo.backend.types import DimuonParams, LoraSpec

DAMPING = 1e-2
RANK_LR_EXPONENT = 0.0
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a quintic that pushes every singular value towards 1
EPS = 1e-7


def matrix_sign(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of each ``[..., m, n]`` matrix (its singular values taken to about 1), by Newton-Schulz
    iterations on the orientation whose Gram matrix is the smaller; zero stays zero."""
    wide = matrix.shape[-2] <= matrix.shape[-1]
    x = (matrix if wide else matrix.mT).float()
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(matrix.dtype)


def preconditioned(momentum: torch.Tensor) -> torch.Tensor:
    """``momentum`` scaled by its rows' and columns' root mean squares (each to the power 1/2), damped."""
    square = momentum * momentum
    damping = DAMPING * square.mean(dim=(-2, -1), keepdim=True) + EPS
    rows = (square.mean(dim=-1, keepdim=True) + damping) ** 0.25
    columns = (square.mean(dim=-2, keepdim=True) + damping) ** 0.25
    return momentum / (rows * columns)


class SlotDimuon:
    """Dimuon steps of adapters in the bank's slots, on the state SlotAdamW keeps (weights, gradients, first moment,
    step counts)."""

    def __init__(self, bank: LoraBank, state: SlotAdamW) -> None:
        self.bank, self.state = bank, state

    @torch.no_grad()
    def step(self, slots: Sequence[int], specs: Sequence[LoraSpec], params: Sequence[DimuonParams]) -> list[float]:
        """One step for these slots (slot i of ``specs[i]`` with ``params[i]``); returns each slot's gradient norm
        before clipping."""
        norms = clip_slots(self.state.grads, slots, [p.grad_clip_norm for p in params])
        for slot in slots:
            self.state.step_counts[slot] += 1
        by_rank: dict[int, list[int]] = {}
        for i, spec in enumerate(specs):
            by_rank.setdefault(spec.rank, []).append(i)
        for rank, members in by_rank.items():
            self._step_rank(rank, [slots[i] for i in members], [specs[i] for i in members],
                            [params[i] for i in members])
        return norms

    def _step_rank(self, rank: int, slots: list[int], specs: list[LoraSpec], params: list[DimuonParams]) -> None:
        like = {"dtype": self.state.weights.dtype, "device": self.state.weights.device}
        rows = torch.tensor(slots, device=like["device"])
        scale = (32 / rank) ** RANK_LR_EXPONENT
        beta1 = torch.tensor([p.beta1 for p in params], **like)
        lr = torch.tensor([p.learning_rate * scale for p in params], **like)
        for n, path in enumerate(self.bank.layers):
            if not any(self.bank.trains(path, spec) for spec in specs):
                continue
            for index in (2 * n, 2 * n + 1):
                where = (rows, Ellipsis, slice(0, rank), slice(None)) if index % 2 == 0 else (rows, Ellipsis,
                                                                                               slice(0, rank))
                weights, grads, momentum = (self.bank.view(flat, index) for flat in (
                    self.state.weights, self.state.grads, self.state.exp_avg))
                moved = momentum[where]
                shape = (len(slots),) + (1,) * (moved.dim() - 1)  # one setting per slot, over its matrices
                moved = moved * beta1.view(shape) + grads[where] * (1 - beta1).view(shape)
                momentum[where] = moved
                weights[where] = weights[where] - lr.view(shape) * matrix_sign(preconditioned(moved))
