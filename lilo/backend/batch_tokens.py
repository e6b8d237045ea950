"""How many padded tokens one forward/backward pass holds by default (``--max-batch-tokens`` when not set).

A training pass keeps, per token, each decoder layer's activations for the backward pass and the full-vocabulary
fp32 logits with their log-softmax and its gradient. ``activation_bytes_per_token`` estimates that from the base
model's shape (measured here on the CPU: SmolLM2-135M in fp32 peaks at 2.35-2.42 MB a token, the estimate says
2.5; the tiny test Llama 136-146 KB, the estimate 127). ``size_batch_tokens`` gives a pass that share of the
memory the device has free once the model and its adapter slots are in, rounded down to a power of two, within
``MIN_BATCH_TOKENS`` and the device's ceiling: on a GPU up to 131,072 tokens; on a CPU at most 8,192, because
there a pass's time grows with its tokens and every other model waits behind it.
"""

from __future__ import annotations

from typing import Any

MIN_BATCH_TOKENS = 256
MAX_BATCH_TOKENS = {"cuda": 131_072, "cpu": 8192}
# Of the memory free after loading, the share a pass's activations may take (the rest: the allocator's slack,
# paging buffers, the sampler's KV cache; on a CPU node also the other processes of the node).
ACTIVATION_SHARE = {"cuda": 0.6, "cpu": 0.25}
# Values a decoder layer keeps per token for its backward pass: per hidden unit (norms, attention's q/k/v/o and
# its output, residuals, LoRA inputs) and per MLP unit (gate, up and their product).
SAVED_PER_HIDDEN = 20
SAVED_PER_INTERMEDIATE = 3
# fp32 logits, their log-softmax and its gradient.
LOGIT_COPIES = 3


def activation_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Estimated bytes a training pass holds per padded token of a model with this transformers ``config``."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_layer = (SAVED_PER_HIDDEN * hidden + SAVED_PER_INTERMEDIATE * intermediate) * dtype_bytes
    return config.num_hidden_layers * per_layer + LOGIT_COPIES * 4 * config.vocab_size


def budget_tokens(free_bytes: int, bytes_per_token: int, device_type: str) -> int:
    """The largest power of two of tokens whose activations fit the device's share of ``free_bytes``, within
    ``MIN_BATCH_TOKENS`` and the device's ceiling."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    fitting = int(ACTIVATION_SHARE[kind] * free_bytes) // max(bytes_per_token, 1)
    tokens = MIN_BATCH_TOKENS
    while tokens * 2 <= min(fitting, MAX_BATCH_TOKENS[kind]):
        tokens *= 2
    return tokens


def size_batch_tokens(model: Any, device: Any, slot_bytes: int = 0) -> int:
    """The default budget for ``model`` (loaded, with its adapter slots allocated) on ``device``: from the GPU's
    free memory under CUDA; on a CPU from the node's available memory less ``slot_bytes``, the slots' whole state,
    which there becomes resident only as slots fill (``lilo.backend.slot_memory``)."""
    import psutil
    import torch

    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = max(0, psutil.virtual_memory().available - slot_bytes)
    dtype_bytes = next(model.parameters()).element_size()
    return budget_tokens(free_bytes, activation_bytes_per_token(model.config, dtype_bytes), device.type)
