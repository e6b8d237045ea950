"""Adapter checkpoints: capture a slot's state to CPU (compute lane), write it to disk (persist lane), load it back.

Two formats:
- ``save_weights``: the adapter and its optimizer state (``state.safetensors`` + ``meta.json``), so training
  resumes exactly after ``load_weights``;
- ``save_weights_for_sampler``: the adapter alone in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained`` loads onto the same base model.
Where they go and how they are named is ``checkpoint_paths``; nothing read back is unpickled (safetensors and JSON
only).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lilo.backend.checkpoints.paths import META_FILE, PEFT_CONFIG, PEFT_WEIGHTS, STATE_FILE
from lilo.backend.adapters.lora import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, UNEMBED
from lilo.backend.types import LoraSpec
from lilo.errors import InvalidRequestError

@dataclasses.dataclass
class AdapterState:
    """One adapter, copied out of its slot: per projection path, A ``(rank, in)`` and B ``(out, rank)``."""

    spec: LoraSpec
    tensors: dict[str, torch.Tensor]  # "<path>.lora_A" / "<path>.lora_B" (and ".exp_avg" / ".exp_avg_sq")
    step: int | None = None  # optimizer steps taken; None when the optimizer state was not captured
    # When the state was copied out of its slot (wall clock); a restore compares it with a page file's.
    captured_at: float | None = None


def write_state(state: AdapterState, directory: Path) -> Path:
    _start_writing(directory, META_FILE)
    save_file({key: tensor.contiguous() for key, tensor in state.tensors.items()}, str(directory / STATE_FILE))
    meta = {"spec": dataclasses.asdict(state.spec), "step": state.step, "captured_at": state.captured_at}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2))
    return directory


def _start_writing(directory: Path, marker: str) -> None:
    """Ready ``directory`` for a checkpoint whose ``marker`` file is written last. A save under an existing name
    drops the old marker first, so a rewrite cut short (a crash, a full disk) never passes for a complete
    checkpoint: it is skipped, and a restore falls back to the checkpoint before it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / marker).unlink(missing_ok=True)


def read_state(directory: Path) -> AdapterState:
    try:
        meta = json.loads((directory / META_FILE).read_text())
        tensors = load_file(str(directory / STATE_FILE))
    except FileNotFoundError:
        raise InvalidRequestError(f"No weights checkpoint at {directory}; pass a path save_weights returned.") from None
    return AdapterState(LoraSpec(**meta["spec"]), tensors, meta["step"], meta.get("captured_at"))


def write_peft(state: AdapterState, directory: Path, base_model: str) -> Path:
    """The adapter as PEFT saves one: keys ``base_model.model.<path>.lora_A.weight``, alpha and rank as trained."""
    _start_writing(directory, PEFT_CONFIG)
    weights = {f"base_model.model.{key}.weight": tensor.contiguous() for key, tensor in state.tensors.items()
               if key.endswith((".lora_A", ".lora_B"))}
    save_file(weights, str(directory / PEFT_WEIGHTS))
    targets = sorted({key.rsplit(".", 2)[-2] for key in state.tensors if key.endswith(".lora_A")})
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": state.spec.rank, "lora_alpha": state.spec.alpha or state.spec.rank, "lora_dropout": 0.0,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }
    (directory / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return directory


def read_peft(directory: Path) -> AdapterState:
    """An adapter ``write_peft`` wrote, back in the backend's keys (``<path>.lora_A``), with its rank and alpha."""
    config = json.loads((directory / PEFT_CONFIG).read_text())
    weights = load_file(str(directory / PEFT_WEIGHTS))
    targets = set(config["target_modules"])
    spec = LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                    train_attn=bool(targets & set(ATTENTION_PROJECTIONS)),
                    train_mlp=bool(targets & set(MLP_PROJECTIONS)), train_unembed=UNEMBED in targets)
    prefix, suffix = "base_model.model.", ".weight"
    tensors = {key[len(prefix):-len(suffix)]: tensor for key, tensor in weights.items()}
    return AdapterState(spec, tensors)
