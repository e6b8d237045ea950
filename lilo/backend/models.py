"""Loading base models: from a local directory (or a hub id, where a hub is reachable) through transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# The tiny test model, exactly as the benchmarks define "tiny".
TINY_LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512)


def build_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """A random-init tiny Llama saved with ``save_pretrained``, so tests load it through the real path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(directory)
    return directory


def load_base_model(source: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``from_pretrained`` on a directory or hub id; the weights are frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()
