"""The optimizer's block-wise fused step: one call for many slots equals each slot stepped alone."""

import pytest
import torch

from lilo.backend.adapters.optimizer import SlotAdamW, slot_runs
from lilo.backend.types import AdamParams


def test_slot_runs_groups_consecutive_slots_in_order():
    assert slot_runs([5, 0, 1, 3, 4, 9, 1]) == [(0, 2), (3, 6), (9, 10)]
    assert slot_runs([]) == []


def optimizer_with_state(slots: int, width: int) -> SlotAdamW:
    generator = torch.Generator().manual_seed(0)
    optimizer = SlotAdamW(torch.randn(slots, width, generator=generator), torch.zeros(slots, width))
    optimizer.set_steps(2, 3)  # slot 2 has stepped before: it may not share a kernel call with its neighbours
    return optimizer


def test_one_call_for_many_slots_equals_each_slot_stepped_alone():
    plain = AdamParams(learning_rate=1e-2, weight_decay=0.1)
    clipped = AdamParams(learning_rate=3e-2, beta1=0.8, grad_clip_norm=0.5)
    hyper = {0: plain, 1: plain, 2: plain, 4: clipped, 5: plain, 6: clipped}
    together, alone = optimizer_with_state(8, 64), optimizer_with_state(8, 64)
    for round_ in range(3):
        grads = torch.randn(8, 64, generator=torch.Generator().manual_seed(round_))
        together.grads.copy_(grads)
        alone.grads.copy_(grads)
        norms = together.step(list(hyper), list(hyper.values()))
        norms_alone = [alone.step([slot], [h])[0] for slot, h in hyper.items()]
        assert norms == pytest.approx(norms_alone, rel=1e-6)
        assert norms == pytest.approx(grads[list(hyper)].norm(dim=1).tolist(), rel=1e-6)
    assert torch.allclose(together.weights, alone.weights, rtol=1e-6, atol=1e-7)
    assert torch.allclose(together.exp_avg_sq, alone.exp_avg_sq, rtol=1e-6, atol=1e-9)
    assert [together.steps(s) for s in range(8)] == [alone.steps(s) for s in range(8)] == [3, 3, 6, 0, 3, 3, 3, 0]
    # Clipping applied: slot 4's gradient (norm about 8) was scaled down before its moments saw it.
    assert float(together.exp_avg[4].norm()) < 0.5


def test_zero_grad_clears_only_the_given_slots():
    optimizer = SlotAdamW(torch.zeros(4, 8), torch.ones(4, 8))
    optimizer.zero_grad([0, 1, 3])
    assert optimizer.grads.sum(dim=1).tolist() == [0.0, 0.0, 8.0, 0.0]
