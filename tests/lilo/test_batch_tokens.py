"""The default pass budget: activations per token from the model's shape, the budget from the free memory."""

from types import SimpleNamespace

import pytest
import torch

from lilo.backend.training.batch_tokens import (
    MAX_BATCH_TOKENS, MIN_BATCH_TOKENS, activation_bytes_per_token, budget_tokens, logit_slice_bytes, longest_sequence,
    recompute_bytes_per_token, size_batch_tokens,
)
from lilo.backend.models import TINY_LLAMA

SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)


def test_activations_per_token_follow_the_models_shape():
    # Measured on the CPU (fp32, benchmarks/bench_memory.py): SmolLM2-135M's pass of 4,096 tokens peaks at 1.8 MB a
    # token, the logits' slice included; the estimate must not be far below.
    assert 1.7e6 <= activation_bytes_per_token(SMOLLM2, dtype_bytes=4) <= 2.2e6
    bf16, fp32 = (activation_bytes_per_token(SMOLLM2, size) for size in (2, 4))
    assert bf16 == fp32 / 2  # the logits are no longer per token: only the layers' activations are


def test_a_sequence_past_the_budget_may_be_several_times_longer_with_its_layers_recomputed():
    assert recompute_bytes_per_token(SMOLLM2, 4) * 8 < activation_bytes_per_token(SMOLLM2, 4)
    assert longest_sequence(SMOLLM2, 4, 2048) > 8 * 2048
    # A model of few layers gains little, but never less than the budget itself.
    assert longest_sequence(SimpleNamespace(**{**vars(SMOLLM2), "num_hidden_layers": 1}), 4, 2048) == 2048


@pytest.mark.parametrize(("free_gb", "per_token_mb", "device", "expected"), [
    (16, 2.5, "cpu", 1024),  # SmolLM2 on this machine: a quarter of 16 GB at 2.5 MB a token
    (16, 0.125, "cpu", MAX_BATCH_TOKENS["cpu"]),  # a tiny model: the CPU ceiling, not the memory, binds
    (100, 2.5, "cuda", 16384),  # SmolLM2 on an H200's free memory, in bf16 or not: many times the CPU's
    (1, 10.0, "cuda", MIN_BATCH_TOKENS),  # nearly full: the floor, so a pass can still run
    (1000, 0.01, "cuda", MAX_BATCH_TOKENS["cuda"]),
])
def test_the_budget_is_the_largest_power_of_two_that_fits_the_devices_share(free_gb, per_token_mb, device,
                                                                            expected):
    assert budget_tokens(int(free_gb * 2**30), int(per_token_mb * 2**20), device) == expected


def test_a_loaded_model_on_the_cpu_gets_a_budget_within_the_bounds():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    assert MIN_BATCH_TOKENS <= size_batch_tokens(model, torch.device("cpu")) <= MAX_BATCH_TOKENS["cpu"]
    # Slots that will take all the memory there is leave a pass the floor.
    assert size_batch_tokens(model, torch.device("cpu"), slot_bytes=2**50) == MIN_BATCH_TOKENS


def test_the_layers_a_sharded_base_gathers_whole_come_off_a_passs_memory():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    per_token = activation_bytes_per_token(model.config, 4)
    free = logit_slice_bytes(model.config) + 8192 * per_token  # well inside the CPU's bounds, under a cap
    whole = size_batch_tokens(model, torch.device("cpu"), capped_free_bytes=free)
    reserved = size_batch_tokens(model, torch.device("cpu"), capped_free_bytes=free, reserved_bytes=4096 * per_token)
    assert MIN_BATCH_TOKENS < reserved < whole
