"""Adapter checkpoints: capture a slot's state to CPU (compute lane), write it to disk (persist lane), load it back.

Two formats:
- ``save_weights``: the adapter and its optimizer state (``state.safetensors`` + ``meta.json``), so training
  resumes exactly after ``load_weights``;
- ``save_weights_for_sampler``: the adapter alone in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained`` loads onto the same base model.
Names are plain file names; nothing a client sends can point outside the checkpoint directory, and nothing read
back is unpickled (safetensors and JSON only).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lilo.backend.lora import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, UNEMBED
from lilo.backend.types import LoraSpec
from lilo.errors import InvalidRequestError

STATE_FILE, META_FILE = "state.safetensors", "meta.json"
TINKER_SCHEME = "tinker://"
KIND_DIRECTORIES = {"save_weights": "weights", "save_weights_for_sampler": "sampler_weights"}
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclasses.dataclass
class AdapterState:
    """One adapter, copied out of its slot: per projection path, A ``(rank, in)`` and B ``(out, rank)``."""

    spec: LoraSpec
    tensors: dict[str, torch.Tensor]  # "<path>.lora_A" / "<path>.lora_B" (and ".exp_avg" / ".exp_avg_sq")
    step: int | None = None  # optimizer steps taken; None when the optimizer state was not captured


def checked_name(name: str) -> str:
    if not NAME_PATTERN.match(name or "") or ".." in name:
        raise InvalidRequestError(
            f"Checkpoint name {name!r} is not allowed; use letters, digits, '.', '_' and '-' (at most 128), "
            "starting with a letter or digit.")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """``tinker://<model_id>/{weights|sampler_weights}/<name>``: how clients name a checkpoint."""
    return f"{TINKER_SCHEME}{model_id}/{KIND_DIRECTORIES[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``(run, kind directory, name)`` of a ``tinker://`` checkpoint path; anything that could leave the
    checkpoint directory is refused."""
    if not path.startswith(TINKER_SCHEME):
        raise InvalidRequestError(f"Checkpoint path {path!r} is not a tinker:// path; pass one save_weights returned.")
    parts = path[len(TINKER_SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KIND_DIRECTORIES.values() or parts[0] in ("", ".", ".."):
        raise InvalidRequestError(f"Checkpoint path {path!r} is not of the form tinker://<run>/weights/<name>.")
    return parts[0], parts[1], checked_name(parts[2])


def sampler_run(path: str) -> str:
    """The training run (model id) that saved the sampler checkpoint ``path``; other paths are refused."""
    run, kind, _ = parse_tinker_path(path)
    if kind != KIND_DIRECTORIES["save_weights_for_sampler"]:
        raise InvalidRequestError(
            f"{path!r} is not a sampler checkpoint; sample from a path save_weights_for_sampler returned "
            "(tinker://<run>/sampler_weights/<name>).")
    return run


def local_directory(root: Path, path: str) -> Path:
    """Where a ``tinker://`` checkpoint lives under ``root``."""
    run, kind, name = parse_tinker_path(path)
    return root / run / kind / name


def write_state(state: AdapterState, directory: Path) -> Path:
    _start_writing(directory, META_FILE)
    save_file({key: tensor.contiguous() for key, tensor in state.tensors.items()}, str(directory / STATE_FILE))
    meta = {"spec": dataclasses.asdict(state.spec), "step": state.step}
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
    return AdapterState(LoraSpec(**meta["spec"]), tensors, meta["step"])


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
