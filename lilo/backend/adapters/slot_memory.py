"""Memory for every adapter slot of a trainer, taken at start and made resident only as slots are used.

A trainer's ``LoraBank`` and optimizer hold max_rank-sized weights, gradients and both Adam moments for every slot
(about 180 MB a slot for SmolLM2 at rank 32): 3.3 GB for the default 18 slots, most of which stays zero until models
arrive. ``torch.zeros`` writes every byte at once, which costs seconds of a trainer's start and makes all of it
resident. On the CPU the slots live in anonymous memory instead, which the kernel hands out zeroed, page by page,
when first touched: a slot costs memory once a model uses it, and start-up writes nothing. Training computes the
same either way (the memory reads as zeros until written).
"""

from __future__ import annotations

import math
import mmap

import torch


def slot_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of ``shape``: on the CPU, of memory made resident as it is touched; elsewhere ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; it is unmapped when the last tensor viewing it is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
