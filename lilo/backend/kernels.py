"""Which implementation runs a family's linear-attention and state-space layers: transformers takes each fast kernel
from its package where that is installed (flash-linear-attention's Gated DeltaNet for Qwen3.5, mamba-ssm's scans for
Nemotron-H, causal-conv1d's convolutions for both) and its torch reference path otherwise, which is right but slow on
a GPU. A trainer logs which, once, when it loads its base model."""

from __future__ import annotations

import importlib.util

from lilo.backend.families import Family


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def kernel_report(family: Family, device_type: str) -> str | None:
    """One line saying which of ``family``'s fast kernels run and which fall back to torch (and what to install),
    or None for a family with none."""
    if not family.kernels:
        return None
    found = {package: installed(module) for module, package in family.kernels.items()}
    present = [package for package, here in found.items() if here]
    missing = [package for package, here in found.items() if not here]
    parts = [f"fast kernels from {', '.join(present)}"] if present else []
    if missing:
        advice = f"; pip install {' '.join(missing)} for its kernels" if device_type == "cuda" else ""
        parts.append(f"the torch reference path for what {', '.join(missing)} would run (not installed{advice})")
    return f"{family.name} layers: {'; '.join(parts)}"
