"""Packed passes (lilo.backend.training.packing) against the padded path they replace: the same losses,
log-probabilities and gradients, for every loss, mixed adapters and ranks, and the families that pack."""

import numpy as np
import pytest
import torch

from helpers import backend_with, image_datum, text_datum, weighted_datum
from lilo.backend.models import build_tiny, load_base_model
from lilo.backend.provenance import PROMPT, SAMPLED, Provenance, RecordedSequence, Span
from lilo.backend.training.loss_inputs import CONFIG_KEYS, NEEDS_PROVENANCE, with_recorded_inputs
from lilo.backend.training.packing import packed_bins
from lilo.backend.types import Datum, LoraSpec, TrainInput
from lilo.backend.vision import image_layout
from lilo.engine.commands import Command, Kind

# Three adapters of different ranks and targets (one trains the unembedding), so one packed stream routes tokens
# to three slots and the unembedding's slices cross adapters.
SPECS = {"r4": LoraSpec(rank=4, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "r16": LoraSpec(rank=16, seed=3, train_mlp=False)}
# Ragged lengths, so padded rows pad and packed bins fill unevenly.
LENGTHS = [23, 7, 31, 12, 5, 18]


def rl_datum(seed: int, length: int, top_k: int = 0) -> Datum:
    """Random tokens with every input any loss takes: weights, sampler logprobs, advantages (top-K targets and
    weights with ``top_k``)."""
    plain = weighted_datum(seed, length)
    rng = np.random.default_rng(seed + 1000)
    inputs = dict(plain.loss_inputs, logprobs=(-rng.random(length) * 3).round(3).tolist(),
                  advantages=rng.normal(size=length).round(3).tolist())
    if top_k:
        inputs["target_tokens"] = rng.integers(0, 1000, (length, top_k)).tolist()
        inputs["weights"] = rng.random((length, top_k)).round(2).tolist()
    return Datum(tokens=plain.tokens, loss_inputs=inputs)


def with_provenance(datum: Datum, sequence_id: str, prompt: int = 4) -> tuple[Datum, RecordedSequence]:
    """``datum`` as a prompt of ``prompt`` tokens and a sampled completion (its targets' rest), with its provenance,
    and the sampler's record of that completion (random logprobs): what stable_reinforce trains on."""
    tokens, targets = np.asarray(datum.tokens), np.asarray(datum.loss_inputs["target_tokens"])
    sampled = targets[prompt - 1:]
    record = RecordedSequence(sequence_id, tokens[:prompt].astype(np.int32), sampled.astype(np.int32),
                              -np.random.default_rng(len(tokens)).random(len(sampled)).astype(np.float32))
    provenance = Provenance((Span(PROMPT, sequence_id, 0, prompt), Span(SAMPLED, sequence_id, 0, len(sampled) - 1)),
                            (Span(PROMPT, sequence_id, 1, prompt - 1), Span(SAMPLED, sequence_id, 0, len(sampled))))
    inputs = {key: datum.loss_inputs[key] for key in ("target_tokens", "advantages")}
    return Datum(tokens=datum.tokens, loss_inputs=inputs, provenance=provenance), record


def command(model_id: str, seq: int, data, loss_fn: str) -> Command:
    train = TrainInput(data=data, loss_fn=loss_fn, loss_config={})
    if loss_fn in NEEDS_PROVENANCE:
        data, records = zip(*(with_provenance(datum, f"{model_id}:{n}") for n, datum in enumerate(data)))
        train = with_recorded_inputs(TrainInput(data=list(data), loss_fn=loss_fn, loss_config={}),
                                     {record.sequence_id: record for record in records})
    return Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}", payload=train, tokens=train.tokens)


def slot_grads(backend, model_id: str) -> list[torch.Tensor]:
    slot = backend.adapters[model_id].slot
    return [backend.bank.view(backend.bank.grads, i)[slot].clone() for i in range(len(backend.bank.shapes))]


def passes_agree(base, specs: dict, commands: list[Command], budget: int, forward_only: bool = False,
                 images=None, gradient_rtol: float = 1e-5) -> None:
    """``commands`` through a packed and a padded backend over ``base``: equal results and gradients (1e-5 relative
    in fp32; ``gradient_rtol`` of each gradient's largest)."""
    packed = backend_with(base, specs, max_adapters=8, max_rank=16, max_batch_tokens=budget, images=images)
    padded = backend_with(base, specs, max_adapters=8, max_rank=16, max_batch_tokens=budget, pack=False,
                          images=images)
    assert packed.packs and not padded.packs
    ours = packed.forward_backward(commands, forward_only=forward_only)
    theirs = padded.forward_backward(commands, forward_only=forward_only)
    for a, b in zip(ours, theirs, strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a["metrics"]["loss:sum"] == pytest.approx(b["metrics"]["loss:sum"], rel=1e-5, abs=1e-6)
        for out_a, out_b in zip(a["loss_fn_outputs"], b["loss_fn_outputs"], strict=True):
            for key in ("logprobs", "elementwise_loss"):
                assert np.allclose(out_a[key], out_b[key], rtol=1e-5, atol=1e-5), key
    for model_id in specs:
        for g_a, g_b in zip(slot_grads(packed, model_id), slot_grads(padded, model_id)):
            assert (g_a - g_b).abs().max().item() <= gradient_rtol * (g_b.abs().max().item() or 1.0)
    if not forward_only:
        assert any(g.abs().max().item() > 0 for g in slot_grads(packed, next(iter(specs))))


def mixed_commands(loss_fn: str, top_k: int = 0) -> list[Command]:
    """A pass of three requests, one per adapter, with ragged datums."""
    return [command(model_id, 1, [rl_datum(10 * n + i, length, top_k) for i, length in
                                  enumerate(LENGTHS[n::len(SPECS)] + LENGTHS[:n])], loss_fn)
            for n, model_id in enumerate(SPECS)]


@pytest.mark.parametrize("loss_fn", list(CONFIG_KEYS))
def test_a_packed_pass_equals_the_padded_one_for_every_loss_and_mixed_adapters(base, loss_fn):
    # A budget of 40 tokens: several packed bins and padded micro-batches.
    passes_agree(base, SPECS, mixed_commands(loss_fn), budget=40)


def test_a_packed_pass_equals_the_padded_one_with_top_k_targets(base):
    passes_agree(base, SPECS, mixed_commands("cross_entropy", top_k=3), budget=64)


def test_a_packed_forward_equals_the_padded_one_and_a_long_datum_recomputes_alone(base):
    passes_agree(base, SPECS, mixed_commands("cross_entropy"), budget=1000, forward_only=True)
    # A datum longer than the budget runs alone, its layers recomputed.
    long_one = [command("r4", 1, [rl_datum(1, 50), rl_datum(2, 9)], "cross_entropy")]
    passes_agree(base, {"r4": SPECS["r4"]}, long_one, budget=32)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-olmo3", "tiny-qwen3.5",
                                  "tiny-qwen3.5-moe", "tiny-qwen3.5-vl", "tiny-nemotron-h",
                                  "tiny-gpt-oss", "tiny-glm5", "tiny-gemma4",
                                  "tiny-deepseek-v4"])
def test_the_families_that_pack_equal_their_padded_passes(tmp_path, name):
    # OLMo 3 with a window shorter than its longer sequences: sliding-window layers pack too. Qwen3.5's linear
    # attention and Nemotron-H's Mamba-2 mixers run once per sequence.
    config = {"sliding_window": 8} if name == "tiny-olmo3" else {}
    directory = build_tiny(tmp_path, name, **config)
    specs = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=8, seed=2, train_unembed=True)}
    commands = [command(model_id, 1, [rl_datum(n + i, length) for i, length in enumerate(LENGTHS[n:n + 3])],
                        "importance_sampling") for n, model_id in enumerate(specs)]
    # Gemma 4's gradients round further apart (its attention runs unscaled): its own eager and SDPA padded passes
    # differ by 2.3e-5 of their largest, packed and padded by 1.5e-5.
    gradient_rtol = 3e-5 if name == "tiny-gemma4" else 1e-5
    # A vision-language checkpoint's text-only passes pack too.
    passes_agree(load_base_model(directory), specs, commands, budget=48, images=image_layout(directory),
                 gradient_rtol=gradient_rtol)


def test_bins_hold_at_most_the_budget_longest_first_and_a_longer_sequence_alone():
    lengths = [5, 40, 12, 30, 8, 100, 3]
    bins = packed_bins(lengths, 50)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [5] in bins  # the one longer than the budget, alone
    assert all(sum(lengths[i] for i in b) <= 50 for b in bins if b != [5])
    # 98 tokens besides the long one fit two bins of 50 and no fewer.
    assert len(bins) == 3


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-qwen3.5-vl", "tiny-kimi-k2.5"])
def test_a_packed_pass_with_images_equals_the_padded_one(tmp_path, name):
    directory = build_tiny(tmp_path, name)
    layout = image_layout(directory)
    specs = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=8, seed=2, train_unembed=True)}
    # Each sequence's multimodal positions start afresh: two images in one adapter's datums, text between them.
    commands = [command("a", 1, [image_datum(layout, 1), text_datum(2, 9), image_datum(layout, 3, (40, 60))],
                        "cross_entropy"),
                command("b", 1, [text_datum(4, 21), image_datum(layout, 5, before=2, after=11)], "cross_entropy")]
    passes_agree(load_base_model(directory), specs, commands, budget=400, images=layout)
