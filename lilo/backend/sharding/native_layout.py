"""A base model's weights stored as the model holds them, for the ranks of a sharded trainer to memory-map.

transformers converts some checkpoints while it loads them: Qwen3-MoE, GPT-OSS and DeepSeek-V3 checkpoints store
each expert's projections apart, and the model fuses them into 3-D tensors (other families rename keys). What a load
converts is a private copy in the loading process, so each of a sharded trainer's N ranks would hold the whole
converted model in host memory before sharding it: N times the experts. Written once per node into lilo's model
cache in the model's own names and shapes, the weights load with no conversion, as views of memory-mapped files
whose pages the node's ranks share, and each rank copies only its shards (``group.load_sharded_base``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

# The most bytes of tensors one file of a converted copy holds: safetensors writes a file from a copy of its
# tensors in memory, so the files are kept small beside the model.
FILE_BYTES = 2 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


def stored_tensor_names(directory: Path) -> set[str]:
    """The names of the tensors a checkpoint directory's safetensors files hold (none without such files)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as stored:
            names |= set(stored.keys())
    return names


def model_tensor_names(directory: Path) -> set[str]:
    """The names of the tensors the model of ``directory``'s config holds (built on the meta device: no memory)."""
    from transformers import AutoConfig

    from lilo.backend.models import held_model

    model_class, config = held_model(AutoConfig.from_pretrained(directory))
    with torch.device("meta"):
        model = model_class.from_config(config)
    return set(model.state_dict())


def converts_on_load(directory: Path) -> bool:
    """Whether loading ``directory`` converts its weights: it stores a tensor the model does not hold by that name."""
    return not stored_tensor_names(directory) <= model_tensor_names(directory)


def native_layout(directory: Path, cache_dir: Path) -> Path:
    """``directory`` itself when it loads as stored (or is not a local directory); otherwise its copy in the model's
    own layout under ``cache_dir``, written by the first process of this node that asks (the others wait for it)
    and kept for every later start while the source files stay as they are."""
    from lilo.backend.models import made_once

    if not directory.is_dir() or not converts_on_load(directory):
        return directory
    target = cache_dir / "native" / f"{directory.name}-{source_fingerprint(directory)}"
    return made_once(target, lambda partial: write_native_copy(directory, partial))


def source_fingerprint(directory: Path) -> str:
    """Names the copy of a checkpoint: its path and its files' names, sizes and modification times."""
    digest = hashlib.sha1(str(directory.resolve()).encode())
    for path in sorted(directory.iterdir()):
        if path.is_file():
            status = path.stat()
            digest.update(f"{path.name}:{status.st_size}:{status.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def write_native_copy(source: Path, target: Path) -> None:
    """Load ``source`` once (converting it), then write its tensors as the model holds them, in files of at most
    ``FILE_BYTES`` with an index, beside a copy of the checkpoint's other files (config, tokenizer)."""
    from safetensors.torch import save_file

    from lilo.backend.models import load_base_model

    logger.warning("writing %s in the model's own layout under %s, once per node, so that the ranks of a sharded "
                   "trainer share it instead of each converting it", source, target.parent)
    model = load_base_model(source, "cpu", dtype="auto")
    target.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    groups = list(file_groups(distinct_tensors(model.state_dict())))
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({key: tensor.contiguous() for key, tensor in group.items()}, target / name,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    total = sum(tensor.numel() * tensor.element_size() for group in groups for tensor in group.values())
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, target / path.name)
    model.config.save_pretrained(target)  # the model's own (a vision-language checkpoint's: its language model's)


def distinct_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second name of a tied tensor (the head tied to the embeddings): the load ties them
    again, as the config says."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    kept = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


def file_groups(state: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """``state`` in runs of at most ``FILE_BYTES`` (a larger tensor alone in its own)."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > FILE_BYTES:
            yield group
            group, size = {}, 0
        group[name] = tensor
        size += nbytes
    if group:
        yield group
