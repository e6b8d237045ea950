"""The sampler groups a generation's rows by adapter slot and runs each group's LoRA delta at its own rank: a mixed
batch samples what each request samples alone, in request order, and rows of no adapter are the bare base model's."""

import copy

import numpy as np
import pytest
import torch

from lilo.backend import sampling
from lilo.backend.adapters.lora import BASE_SLOT, BATCHED, RUNS
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import LoraSpec, SamplingRequest
from lilo.engine.commands import Command, Kind

# Four adapters of different ranks (two with an lm_head LoRA, one without MLP LoRA), padded to max rank 16.
SPECS = {"r2": LoraSpec(rank=2, seed=1), "r4": LoraSpec(rank=4, seed=2, train_unembed=True),
         "r8": LoraSpec(rank=8, seed=3, train_mlp=False), "r16": LoraSpec(rank=16, alpha=32, seed=4,
                                                                         train_unembed=True)}


@pytest.fixture(scope="module")
def backend(base):
    """The four adapters, each with a random non-zero B (a fresh adapter's B is zero: its delta would be too)."""
    backend = TorchBackend(copy.deepcopy(base), max_adapters=4, max_rank=16, sampler_slots=0)
    generator = torch.Generator().manual_seed(0)
    for model_id, spec in SPECS.items():
        backend.add_adapter(model_id, spec)
        slot = backend.adapters[model_id].slot
        with torch.no_grad():
            for layer in backend.layers.values():
                if layer.trained[slot]:
                    b = torch.randn(layer.lora_B.shape[1], spec.rank, generator=generator) * 0.2
                    layer.lora_B[slot, :, :spec.rank] = b
    return backend


def prompt(n: int) -> list[int]:
    return np.random.default_rng(n).integers(0, 1000, 5 + 3 * n % 11).tolist()


# Request order interleaves adapters and base rows, so grouping by slot reorders them; some ask for several samples.
MIX = ["r16", None, "r2", "r8", None, "r4", "r2", "r16", None, "r4"]


def commands(settings: dict) -> list[Command]:
    made = []
    for n, model_id in enumerate(MIX):
        request = SamplingRequest(prompt=prompt(n), max_tokens=6, num_samples=1 + n % 3, seed=100 + n,
                                  base_only=model_id is None, **settings)
        made.append(Command(model_id or "r2", n, Kind.SAMPLE, f"s{n}", payload=request))
    return made


def assert_same(together: dict, alone: dict) -> None:
    assert len(together["sequences"]) == len(alone["sequences"])
    for ours, theirs in zip(together["sequences"], alone["sequences"]):
        assert ours["tokens"] == theirs["tokens"]
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)


@pytest.mark.parametrize("settings", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}],
                         ids=["greedy", "seeded", "seeded-top-k"])
def test_a_batch_of_four_ranks_and_base_rows_samples_what_each_request_samples_alone(backend, settings):
    batch = commands(settings)
    together = backend.sample(batch)
    for n, command in enumerate(batch):
        (alone,) = backend.sample([command])
        assert_same(together[n], alone)
    # Each request's answer is its own (in request order): distinct prompts and adapters give distinct tokens.
    firsts = [result["sequences"][0]["tokens"] for result in together]
    assert len({tuple(tokens) for tokens in firsts}) == len(firsts)


def test_a_base_row_beside_adapter_rows_samples_the_bare_models_greedy_tokens(backend, base):
    greedy = {"temperature": 0.0, "prompt_logprobs": True}
    results = backend.sample(commands(greedy))
    for n, model_id in enumerate(MIX):
        if model_id is not None:
            continue
        tokens = prompt(n)
        expected = []
        with torch.no_grad():  # the unwrapped base model, one token at a time, no cache, no batch mates
            for _ in range(6):
                logits = base(input_ids=torch.as_tensor([tokens + expected])).logits[0]
                expected.append(int(logits[-1].argmax()))
            logprobs = torch.log_softmax(logits, -1)
        for sequence in results[n]["sequences"]:
            assert sequence["tokens"] == expected
            assert sequence["logprobs"] == pytest.approx(
                [float(logprobs[len(tokens) - 1 + k, t]) for k, t in enumerate(expected)], abs=1e-5)
        assert results[n]["prompt_logprobs"][1:] == pytest.approx(
            [float(logprobs[k, t]) for k, t in enumerate(tokens[1:])], abs=1e-5)
    adapter_firsts = {tuple(results[n]["sequences"][0]["tokens"]) for n, m in enumerate(MIX) if m is not None}
    assert tuple(expected) not in adapter_firsts  # the adapters answer differently: their deltas are real


def test_per_run_deltas_equal_the_per_row_gathered_ones(backend):
    # Rows of one slot need not be side by side (the sampler sorts them, a caller may not): every run is its own.
    slots = [backend.adapters[m].slot if m else BASE_SLOT for m in ["r16", None, "r2", "r2", "r8", "r16", "r4", None]]
    ids = torch.as_tensor([prompt(3)[:5] for _ in slots]) + torch.arange(len(slots)).unsqueeze(-1)
    outputs = []
    with torch.no_grad():
        for mode in (BATCHED, RUNS):
            backend.bank.route(slots, mode)
            try:
                outputs.append(backend.model(input_ids=ids).logits)
            finally:
                backend.bank.route(None)
    assert (outputs[0] - outputs[1]).abs().max().item() <= 1e-5


# Mixed settings in one step (greedy, two temperatures, top-k and top-p: those two go through sample_next), and the
# usual batch: one temperature for every row.
MIXED = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 1.0},
         {"temperature": 0.9, "top_k": 50}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7}]


@pytest.mark.parametrize("settings", [MIXED, [{"temperature": 1.0}] * 5], ids=["mixed", "one-temperature"])
def test_a_batched_sampling_step_draws_what_sample_next_draws_row_by_row(settings):
    logits = torch.randn(len(settings), 1000, generator=torch.Generator().manual_seed(5)) * 3

    def rows() -> list[sampling.Row]:
        return [sampling.Row(n, 0, SamplingRequest(prompt=[1], **s), sampling._generator(7, n))
                for n, s in enumerate(settings)]

    tokens, logprobs = sampling.sample_step(logits, rows())
    for n, row in enumerate(rows()):
        token, expected = sampling.sample_next(logits[n], row.settings, row.generator)
        assert tokens[n] == token
        assert torch.equal(logprobs[n], expected)
    # The same generators, one step after another, go on drawing the same tokens.
    batched, separate = rows(), rows()
    for _ in range(3):
        tokens, _ = sampling.sample_step(logits, batched)
        assert tokens == [sampling.sample_next(logits[n], row.settings, row.generator)[0]
                          for n, row in enumerate(separate)]
