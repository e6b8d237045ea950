"""A pass's memory: the targets' log-probabilities a slice at a time, top-K cross-entropy on them, a sequence longer
than the budget run with its layers recomputed, one no pass can hold refused before it runs, and a pass that runs
out of memory failing its requests with a message and leaving their models as they were."""

import re
import resource

import numpy as np
import pytest
import torch

from lilo.backend.training.loss_inputs import check_train_input
from lilo.backend.training.memory_cap import data_bytes
from lilo.backend.training.recompute import recomputed_layers
from lilo.backend.training.token_logprobs import target_logprobs
from lilo.backend.types import Datum, LoraSpec, TrainInput
from lilo.errors import InvalidRequestError, TooLargeError
from test_torch_backend import datum, fresh_backend, slot_grads, step

K = 3


def top_k_datum(seed: int, length: int = 16, k: int = K) -> Datum:
    """A soft-target distillation datum: K teacher tokens per position, weighted by their teacher probabilities."""
    rng = np.random.default_rng(seed)
    weights = rng.random((length, k))
    return Datum(tokens=rng.integers(0, 1000, length).tolist(), loss_inputs={
        "target_tokens": rng.integers(0, 1000, (length, k)), "weights": weights / weights.sum(1, keepdims=True)})


def one_target_data(top_k: Datum) -> list[Datum]:
    """The K one-target-per-token datums (the k-th targets and weights of each position) a top-K datum sums."""
    targets, weights = (np.asarray(top_k.loss_inputs[key]) for key in ("target_tokens", "weights"))
    return [Datum(tokens=top_k.tokens, loss_inputs={"target_tokens": targets[:, k], "weights": weights[:, k]})
            for k in range(targets.shape[1])]


def test_top_k_cross_entropy_is_the_docs_formula_in_value_logprobs_and_gradient(base):
    spec = {"a": LoraSpec(rank=4, seed=1, train_unembed=True)}
    top_k, summed = fresh_backend(base, spec), fresh_backend(base, spec)
    data = [top_k_datum(0), top_k_datum(1, length=11)]
    (result,) = top_k.forward_backward([step("a", 1, data)], forward_only=False)
    # -sum_t sum_k w[t,k] log p(x[t,k]): the sum, over k, of cross-entropy on the k-th targets alone.
    (reference,) = summed.forward_backward([step("a", 1, [d for top in data for d in one_target_data(top)])],
                                           forward_only=False)
    assert result["metrics"]["loss:sum"] == pytest.approx(reference["metrics"]["loss:sum"], rel=1e-5)
    for g_top_k, g_summed in zip(slot_grads(top_k, "a"), slot_grads(summed, "a")):
        assert (g_top_k - g_summed).abs().max().item() <= 1e-5 * (g_summed.abs().max().item() or 1.0)
    # logprobs come back (tokens, K): each the log-softmax of the model's own logits at its target.
    with torch.no_grad():
        logits = top_k.model(input_ids=torch.tensor([data[0].tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(data[0].loss_inputs["target_tokens"]))
    logprobs = np.asarray(result["loss_fn_outputs"][0]["logprobs"])
    assert logprobs.shape == (16, K) and np.asarray(result["loss_fn_outputs"][1]["logprobs"]).shape == (11, K)
    np.testing.assert_allclose(logprobs, expected.numpy(), rtol=1e-5, atol=1e-5)
    elementwise = np.asarray(result["loss_fn_outputs"][0]["elementwise_loss"])
    np.testing.assert_allclose(elementwise, -logprobs * data[0].loss_inputs["weights"], rtol=1e-5, atol=1e-6)


def test_top_k_and_one_target_requests_share_a_pass(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=1), "b": LoraSpec(seed=2)})
    together = backend.forward_backward([step("a", 1, [top_k_datum(2)]), step("b", 1, [datum(3)])], forward_only=True)
    alone = [backend.forward_backward([command], forward_only=True)[0]
             for command in (step("a", 1, [top_k_datum(2)]), step("b", 1, [datum(3)]))]
    assert np.asarray(together[0]["loss_fn_outputs"][0]["logprobs"]).shape == (16, K)
    assert np.asarray(together[1]["loss_fn_outputs"][0]["logprobs"]).shape == (24,)
    for mixed, single in zip(together, alone):
        assert mixed["metrics"]["loss:sum"] == pytest.approx(single["metrics"]["loss:sum"], rel=1e-5)


@pytest.mark.parametrize(("loss_fn", "inputs", "words"), [
    ("importance_sampling", {"advantages": np.ones((8, 2))}, "importance_sampling defines no such input"),
    ("cross_entropy", {"weights": np.ones((8, 2))}, "target_tokens [8] and weights [8, 2] differ in shape"),
    ("cross_entropy", {"weights": np.ones((8, 2, 2)), "target_tokens": np.ones((8, 2, 2), dtype=int)},
     "send one value per token"),
])
def test_two_dimensional_inputs_only_where_the_loss_defines_them(loss_fn, inputs, words):
    loss_inputs = {"target_tokens": np.arange(8), "weights": np.ones(8), "logprobs": np.zeros(8),
                   "advantages": np.ones(8), **inputs}
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        check_train_input(TrainInput(data=[Datum(tokens=list(range(8)), loss_inputs=loss_inputs)], loss_fn=loss_fn))


def test_log_probabilities_a_slice_at_a_time_equal_the_whole_passes(base):
    backend = fresh_backend(base, {"a": LoraSpec(rank=4, seed=1, train_unembed=True)})
    backend._route([backend.adapters["a"].slot] * 2)
    hidden = torch.randn(2, 13, base.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, 1000, (2, 13, 2))
    unembed = backend.model.get_output_embeddings()
    results = []
    for chunk_tokens in (10_000, 3):  # one slice; slices of one position (3 // 2 rows), the last one short
        values = target_logprobs(hidden, unembed, targets, chunk_tokens)
        (values * torch.linspace(0, 1, 13).view(1, -1, 1)).sum().backward()
        results.append((values.detach(), hidden.grad.clone(), unembed.lora_B.grad.clone()))
        hidden.grad = None
        backend.optimizer.zero_grad(list(range(backend.bank.weights.shape[0])))
    for whole, sliced in zip(*results):
        torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)


def test_a_sequence_longer_than_the_budget_runs_recomputed_with_the_same_gradients(base):
    long = [datum(4, length=56)]
    spec = {"a": LoraSpec(rank=8, seed=1)}
    roomy, tight = fresh_backend(base, spec), fresh_backend(base, spec)
    tight.max_batch_tokens = 32  # the row is past the budget: it runs alone, its layers recomputed
    assert tight.longest_datum() >= 56
    results = [backend.forward_backward([step("a", 1, long)], forward_only=False)[0] for backend in (roomy, tight)]
    assert results[0]["metrics"]["loss:sum"] == pytest.approx(results[1]["metrics"]["loss:sum"], rel=1e-5)
    for g_roomy, g_tight in zip(slot_grads(roomy, "a"), slot_grads(tight, "a")):
        assert (g_roomy - g_tight).abs().max().item() <= 1e-5 * (g_roomy.abs().max().item() or 1.0)
    # Recomputation lasts the pass only: the layers run as themselves again.
    assert all("forward" not in vars(layer) for layer in tight.decoder_layers)


def test_recomputed_layers_compute_what_the_layers_compute(base):
    backend = fresh_backend(base, {"a": LoraSpec(rank=4, seed=1)})
    backend._route([backend.adapters["a"].slot])
    tokens = torch.tensor([datum(5).tokens])
    plain = backend.model(input_ids=tokens).logits
    with recomputed_layers(backend.decoder_layers):
        recomputed = backend.model(input_ids=tokens).logits
    torch.testing.assert_close(recomputed, plain)


def test_a_datum_no_pass_can_hold_is_refused_before_it_runs_saying_what_fits(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=1)})
    backend.max_batch_tokens = 16
    longest = backend.longest_datum()
    with pytest.raises(TooLargeError, match=f"Datum 1 has {longest + 1} tokens.*at most {longest} tokens"):
        backend.check_fits(TrainInput(data=[datum(6), datum(7, length=longest + 1)]))
    weights_before = backend.bank.weights.clone()
    (result,) = backend.forward_backward([step("a", 1, [datum(7, length=longest + 1)])], forward_only=False)
    assert isinstance(result, TooLargeError)
    assert torch.equal(backend.bank.weights, weights_before) and not backend.bank.grads.any()


def test_a_pass_that_runs_out_of_memory_fails_its_requests_and_leaves_their_gradients_as_they_were(base):
    """A real allocation failure: this process's data is capped (RLIMIT_DATA, what a trainer's memory cap sets)
    just above what it holds, then a pass needs far more."""
    backend = fresh_backend(base, {"a": LoraSpec(seed=1), "b": LoraSpec(seed=2)})
    backend.forward_backward([step("a", 1, [datum(8)])], forward_only=False)  # "a" accumulates gradients
    before = {model: slot_grads(backend, model) for model in ("a", "b")}
    backend.max_batch_tokens = 1 << 16
    huge = [datum(9 + n, length=1024) for n in range(16)]  # one pass of 16k tokens: about 2.5 GB here
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + 300 * 2**20, hard))
    try:
        results = backend.forward_backward([step("a", 2, huge[:8]), step("b", 1, huge[8:])], forward_only=False)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    for result, (model, seq) in zip(results, (("a", 2), ("b", 1))):
        assert isinstance(result, TooLargeError), result
        assert f"request {model}:{seq} of model {model} ran out of this trainer's memory" in str(result)
    for model, grads in before.items():
        assert all(torch.equal(g, h) for g, h in zip(grads, slot_grads(backend, model)))
    # The trainer goes on: the next request of each model runs.
    assert all("metrics" in r for r in backend.forward_backward([step("b", 2, [datum(10)])], forward_only=False))
