"""The two transfers of a pass besides FSDP's own: changed adapters' weights from rank 0 to every follower, and
the followers' LoRA gradients summed into rank 0's. Both move only the entries each adapter trains."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from lilo.backend.sharding.plans import SlotUpdate
from lilo.backend.types import LoraSpec

EntryIndex = Callable[[LoraSpec], torch.Tensor]


def broadcast_slots(weights: torch.Tensor, updates: Sequence[SlotUpdate], entries: EntryIndex) -> int:
    """Rank 0 sends, the others receive, the trained entries of each updated slot of ``weights`` (a follower's
    other entries of that slot become zero). Returns the bytes each follower receives."""
    if not updates:
        return 0
    indices = [entries(update.spec) for update in updates]
    if dist.get_rank() == 0:
        packed = torch.cat([weights[u.slot].index_select(0, index) for u, index in zip(updates, indices)])
    else:
        packed = torch.empty(sum(index.numel() for index in indices), dtype=weights.dtype, device=weights.device)
    dist.broadcast(packed, src=0)
    if dist.get_rank() != 0:
        for update, index, part in zip(updates, indices, packed.split([i.numel() for i in indices])):
            weights[update.slot].zero_()
            weights[update.slot].index_copy_(0, index, part)
    return packed.nbytes


def sum_gradients(grads: torch.Tensor, slots: Sequence[SlotUpdate], entries: EntryIndex) -> int:
    """Every rank's gradients of ``slots`` summed into rank 0's rows (rank 0's may hold earlier passes' too).
    Returns the bytes each follower sends."""
    if not slots:
        return 0
    indices = [entries(slot.spec) for slot in slots]
    packed = torch.cat([grads[s.slot].index_select(0, index) for s, index in zip(slots, indices)])
    dist.reduce(packed, dst=0)
    if dist.get_rank() == 0:
        for slot, index, part in zip(slots, indices, packed.split([i.numel() for i in indices])):
            grads[slot.slot].index_copy_(0, index, part)
    return packed.nbytes
