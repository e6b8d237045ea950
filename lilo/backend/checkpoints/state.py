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
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lilo.backend.checkpoints.paths import META_FILE, PEFT_CONFIG, PEFT_WEIGHTS, STATE_FILE
from lilo.backend.adapters.experts import EXPERT_ORDER
from lilo.backend.families import ANY_FAMILY, UNEMBED, role_of
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
    """The adapter as PEFT saves one: keys ``base_model.model.<path>.lora_A.weight``, alpha and rank as trained;
    fused MoE experts' adapters as PEFT's ``target_parameters`` lay them out (``_peft_experts``)."""
    _start_writing(directory, PEFT_CONFIG)
    adapters = {key: tensor for key, tensor in state.tensors.items() if key.endswith((".lora_A", ".lora_B"))}
    experts = _expert_parameters(adapters)
    weights = {}
    for key, tensor in adapters.items():
        path, factor = key.rsplit(".", 1)
        if path in experts:
            module, depth = experts[path]
            weights[f"base_model.model.{module}{'.base_layer' * depth}.{factor}.weight"] = _peft_experts(
                factor, tensor)
        else:
            weights[f"base_model.model.{key}.weight"] = tensor.contiguous()
    save_file(weights, str(directory / PEFT_WEIGHTS))
    # Each projection by its path within a decoder layer (``self_attn.q_proj``; peft matches a name's end), not its
    # last name alone: a frozen module may share that (DeepSeek-V4's indexer.kv_proj beside the attention's kv_proj).
    targets = sorted({_in_layer(key.rsplit(".", 1)[0]) for key in adapters if key.endswith(".lora_A")
                      and key.rsplit(".", 1)[0] not in experts})
    # Beside fused experts, a dense MLP's linears are named by their weights, as parameters: peft reads the
    # gate_proj / up_proj / down_proj modules of an MoE model (DeepSeek-V3, Qwen2-MoE) as transformers 4's expert
    # linears and retargets them at the fused experts, but leaves target_parameters as written. A 2-D parameter's
    # A and B are a linear's (peft's ParamWrapper), so the weights file is the same either way.
    dense_mlp = [target for target in targets if role_of(ANY_FAMILY, target) == "mlp"] if experts else []
    targets = [target for target in targets if target not in dense_mlp]
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": state.spec.rank, "lora_alpha": state.spec.alpha or state.spec.rank, "lora_dropout": 0.0,
        "target_modules": _nested_targets(adapters, targets) or targets, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }
    if experts:
        config["target_parameters"] = _expert_targets(experts) + [f"{name}.weight" for name in dense_mlp]
    (directory / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return directory


# A module path's part up to and past its decoder layer's index (``model.language_model.layers.3.``); group 1: the
# layers' own path.
LAYER_PREFIX = re.compile(r"^(.*?\blayers\.)\d+\.")


def _nested_targets(adapters: dict[str, torch.Tensor], targets: list[str]) -> str | None:
    """For a language model nested in a larger one (a vision-language model's ``model.language_model.layers``),
    ``target_modules`` as the regular expression peft takes, anchored at its layers: a vision tower's projections
    of the same names (Qwen2.5-VL's ``mlp.gate_proj``) stay bare. None for a plain causal LM's ``model.layers``."""
    prefixes = {match.group(1) for key in adapters if (match := LAYER_PREFIX.match(key))}
    if prefixes <= {"model.layers."}:
        return None
    in_layer = [re.escape(target) for target in targets if target != UNEMBED]
    pattern = f"({'|'.join(map(re.escape, sorted(prefixes)))})\\d+\\.({'|'.join(in_layer)})"
    return f"{pattern}|{UNEMBED}" if UNEMBED in targets else pattern


def _in_layer(path: str) -> str:
    """A module's path within its decoder layer (``self_attn.q_proj``), or the whole path outside the layers."""
    return LAYER_PREFIX.sub("", path, count=1)


def _expert_parameters(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[str, int]]:
    """Per fused expert projection (``<experts path>.<name>``, its A 3-D), its module's path and how deep PEFT
    nests its wrapper there: PEFT wraps a module once per targeted parameter, the first in ``target_parameters``
    innermost (``base_layer`` of the next)."""
    paths = [key.rsplit(".", 1)[0] for key, tensor in adapters.items() if key.endswith(".lora_A") and tensor.dim() == 3]
    by_module: dict[str, list[str]] = {}
    for path in paths:
        module, name = path.rsplit(".", 1)
        by_module.setdefault(module, []).append(name)
    found = {}
    for module, names in by_module.items():
        ordered = sorted(names, key=EXPERT_ORDER.index)
        found.update({f"{module}.{name}": (module, len(ordered) - 1 - i) for i, name in enumerate(ordered)})
    return found


def _expert_targets(experts: dict[str, tuple[str, int]]) -> list[str]:
    """``target_parameters``: the fused projections' names under their module's (``experts.down_proj``), in the
    order that nests them as ``_expert_parameters`` says."""
    names = sorted({path.rsplit(".", 1)[1] for path in experts}, key=EXPERT_ORDER.index)
    module = next(iter(experts.values()))[0].rsplit(".", 1)[-1]
    return [f"{module}.{name}" for name in names]


def _peft_experts(factor: str, tensor: torch.Tensor) -> torch.Tensor:
    """lilo's A ``(experts, rank, in)`` or B ``(experts, out, rank)`` in PEFT's layout: A ``(experts x rank, in)``,
    expert-major; B ``(out, rank x experts)``, expert-minor."""
    count, first, second = tensor.shape
    if factor == "lora_A":
        return tensor.reshape(count * first, second).contiguous()
    return tensor.permute(1, 2, 0).reshape(first, second * count).contiguous()


def _lilo_experts(factor: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of ``_peft_experts``."""
    if factor == "lora_A":
        return tensor.reshape(-1, rank, tensor.shape[1])
    out = tensor.shape[0]
    return tensor.reshape(out, rank, -1).permute(2, 0, 1).contiguous()


def read_peft(directory: Path) -> AdapterState:
    """An adapter ``write_peft`` wrote, back in the backend's keys (``<path>.lora_A``), with its rank and alpha."""
    config = json.loads((directory / PEFT_CONFIG).read_text())
    weights = load_file(str(directory / PEFT_WEIGHTS))
    parameters = config.get("target_parameters", [])
    expert_names = [name.rsplit(".", 1)[-1] for name in parameters if not name.endswith(".weight")]
    rank = int(config["r"])
    prefix, suffix = "base_model.model.", ".weight"
    # What trains, read from the weights themselves (target_modules may be a list or a regular expression).
    paths = {key[len(prefix):].rsplit(".lora_A", 1)[0] for key in weights if ".lora_A" in key}
    roles = {role_of(ANY_FAMILY, _in_layer(path.replace(".base_layer", ""))) for path in paths}
    spec = LoraSpec(rank=rank, alpha=float(config["lora_alpha"]), train_attn="attn" in roles,
                    train_mlp="mlp" in roles or bool(expert_names), train_unembed=UNEMBED in paths)
    expert_module = _expert_module(config) if expert_names else None
    tensors = {}
    for key, tensor in weights.items():
        path, factor = key[len(prefix):-len(suffix)].rsplit(".", 1)
        if expert_names and (path.endswith(".base_layer") or path.rsplit(".", 1)[-1] == expert_module):
            module = path.replace(".base_layer", "")
            depth = path.count(".base_layer")
            name = expert_names[len(expert_names) - 1 - depth]
            tensors[f"{module}.{name}.{factor}"] = _lilo_experts(factor, tensor, rank)
        else:
            tensors[f"{path}.{factor}"] = tensor
    return AdapterState(spec, tensors)


def _expert_module(config: dict[str, Any]) -> str:
    """The name of the modules holding the fused experts the adapter targets (``experts``)."""
    return config["target_parameters"][0].rsplit(".", 1)[0]
