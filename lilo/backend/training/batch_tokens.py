"""What one forward/backward pass holds in memory, and so how many tokens it may compute by default
(``--max-batch-tokens`` when not set) and how long a single sequence may be at all.

A training pass keeps, per token, each decoder layer's activations for the backward pass
(``activation_bytes_per_token``, from the base model's shape); the target tokens' log-probabilities come from the
unembedding a slice of tokens at a time (``training.token_logprobs``), so the full-vocabulary logits cost one
slice's worth per pass (``logit_slice_bytes``), not bytes per token. ``size_batch_tokens`` gives a pass its share of
the memory the device has free once the model and its adapter slots are in (or of the trainer's memory cap, where it
has one), rounded down to a power of two, within ``MIN_BATCH_TOKENS`` and the device's ceiling: on a GPU up to
131,072 tokens; on a CPU at most 8,192, because there a pass's time grows with its tokens and every other model
waits behind it.

A sequence longer than the budget runs alone with its decoder layers recomputed in the backward pass (activation
checkpointing: ``recompute_bytes_per_token`` a token, each layer's input kept and one layer's activations at a
time), which costs one more forward but holds several times the tokens in the same memory
(``longest_sequence``); a sequence longer than that is refused before it runs. Measured on this project's CPU
(``benchmarks/bench_memory.py``, fp32) against these estimates: docs/benchmarks.md.
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
# Tokens whose logits exist at once (lilo.backend.training.token_logprobs; for SmolLM2, 256 x 49,152 fp32 values are
# 50 MB a copy), and the copies: the logits, their softmax and the gradient.
LOGIT_COPIES = 3
LOGIT_SLICE_TOKENS = 256


def layer_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """What one decoder layer keeps per token for its backward pass."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return (SAVED_PER_HIDDEN * hidden + SAVED_PER_INTERMEDIATE * intermediate) * dtype_bytes


def activation_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Estimated bytes a training pass holds per padded token of a model with this transformers ``config``."""
    return config.num_hidden_layers * layer_bytes_per_token(config, dtype_bytes)


def recompute_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """The same with every decoder layer recomputed in the backward pass: each layer's input, and one layer's
    activations (and their gradients) at a time."""
    return config.num_hidden_layers * config.hidden_size * dtype_bytes + 2 * layer_bytes_per_token(config, dtype_bytes)


def logit_slice_bytes(config: Any) -> int:
    """What computing the targets' log-probabilities holds at once, whatever the pass's length."""
    return LOGIT_COPIES * 4 * config.vocab_size * LOGIT_SLICE_TOKENS


def longest_sequence(config: Any, dtype_bytes: int, batch_tokens: int) -> int:
    """The longest single sequence a pass takes: in the memory ``batch_tokens`` tokens take, with its layers
    recomputed."""
    budget = batch_tokens * activation_bytes_per_token(config, dtype_bytes)
    return max(batch_tokens, budget // recompute_bytes_per_token(config, dtype_bytes))


def budget_tokens(free_bytes: int, bytes_per_token: int, device_type: str) -> int:
    """The largest power of two of tokens whose activations fit the device's share of ``free_bytes``, within
    ``MIN_BATCH_TOKENS`` and the device's ceiling."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    fitting = int(ACTIVATION_SHARE[kind] * free_bytes) // max(bytes_per_token, 1)
    tokens = MIN_BATCH_TOKENS
    while tokens * 2 <= min(fitting, MAX_BATCH_TOKENS[kind]):
        tokens *= 2
    return tokens


def size_batch_tokens(model: Any, device: Any, slot_bytes: int = 0, capped_free_bytes: int | None = None,
                      reserved_bytes: int = 0) -> int:
    """The default budget for ``model`` (loaded, with its adapter slots allocated) on ``device``: from the GPU's
    free memory under CUDA; on a CPU from the node's available memory less ``slot_bytes``, the slots' whole state,
    which there becomes resident only as slots fill (``lilo.backend.adapters.slot_memory``), or from what the trainer's
    memory cap leaves it (``capped_free_bytes``) when that is less; less ``reserved_bytes`` either way (the layers a
    sharded base gathers whole while a pass runs)."""
    import psutil
    import torch

    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = max(0, psutil.virtual_memory().available - slot_bytes)
        if capped_free_bytes is not None:
            free_bytes = min(free_bytes, capped_free_bytes)
    text = model.config.get_text_config()  # a vision-language model's language model
    free_bytes = max(0, free_bytes - logit_slice_bytes(text) - reserved_bytes)
    dtype_bytes = next(model.parameters()).element_size()
    return budget_tokens(free_bytes, activation_bytes_per_token(text, dtype_bytes), device.type)
