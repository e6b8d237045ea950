"""Dimuon (lilo.backend.adapters.dimuon) on the tiny model: its matrix sign, one step against the documented rule
written out per matrix, models of different ranks and settings stepping together as each would alone, training,
save_state / load_state resuming bit-identically, and steps of the other family refused for that model alone."""

import pytest
import torch

from helpers import backend_with, weighted_datum
from lilo.backend.adapters.dimuon import DAMPING, EPS, matrix_sign
from lilo.backend.types import AdamParams, DimuonParams, LoadRequest, LoraSpec, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind
from lilo.errors import InvalidRequestError


def dimuon(rank: int, seed: int) -> LoraSpec:
    return LoraSpec(rank=rank, seed=seed, optimizer="dimuon")


def backward(backend, model_id: str, seq: int) -> float:
    train = TrainInput(data=[weighted_datum(seq, 24), weighted_datum(seq + 50, 17)])
    command = Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}", payload=train, tokens=train.tokens)
    return backend.forward_backward([command], False)[0]["metrics"]["loss:sum"]


def optim(model_id: str, seq: int, params) -> Command:
    return Command(model_id, seq, Kind.OPTIM_STEP, f"{model_id}:{seq}", payload=params)


def test_the_matrix_sign_takes_singular_values_to_about_one_and_zero_stays_zero():
    matrices = torch.randn(3, 8, 200) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    signs = matrix_sign(matrices)
    values = torch.linalg.svdvals(signs)
    assert values.min() > 0.6 and values.max() < 1.3  # the quintic's band around 1
    assert torch.allclose(torch.linalg.matrix_norm(signs), torch.full((3,), 8 ** 0.5), rtol=0.2)
    tall = matrix_sign(matrices.mT)  # either orientation
    assert torch.allclose(tall, signs.mT, atol=1e-5)
    assert torch.equal(matrix_sign(torch.zeros(2, 4, 9)), torch.zeros(2, 4, 9))


def reference_step(weight, grad, momentum, params: DimuonParams):
    """The rule docs/losses.md and the module's docstring state, on one matrix (gradients already clipped)."""
    momentum = params.beta1 * momentum + (1 - params.beta1) * grad
    square = momentum ** 2
    damping = DAMPING * square.mean() + EPS
    rows = (square.mean(dim=-1, keepdim=True) + damping) ** 0.25
    columns = (square.mean(dim=-2, keepdim=True) + damping) ** 0.25
    return weight - params.learning_rate * matrix_sign(momentum / (rows * columns)), momentum


def test_a_step_follows_the_rule_and_models_step_together_as_each_alone(base):
    specs = {"a": dimuon(4, 1), "b": dimuon(8, 2), "c": dimuon(4, 3)}
    params = {"a": DimuonParams(learning_rate=1e-2), "b": DimuonParams(learning_rate=3e-3, beta1=0.5),
              "c": DimuonParams(learning_rate=2e-2, grad_clip_norm=1e-3)}
    together, alone = (backend_with(base, specs, max_adapters=4, max_rank=8) for _ in range(2))
    for model_id in specs:
        backward(together, model_id, 1)
        backward(alone, model_id, 1)
    slot = together.adapters["a"].slot
    weights, grads = (together.bank.view(flat, 0)[slot, :4].clone() for flat in (together.bank.weights,
                                                                                 together.bank.grads))
    expected, _ = reference_step(weights, grads, torch.zeros_like(weights), params["a"])
    together.optim_step([optim(model_id, 2, params[model_id]) for model_id in specs])
    for model_id in specs:
        alone.optim_step([optim(model_id, 2, params[model_id])])
    torch.testing.assert_close(together.bank.view(together.bank.weights, 0)[slot, :4], expected)
    torch.testing.assert_close(together.bank.weights, alone.bank.weights, rtol=1e-5, atol=1e-7)
    # Rank padding and untrained entries stay exactly zero.
    assert torch.count_nonzero(together.bank.view(together.bank.weights, 0)[slot, 4:]) == 0


def train(backend, model_id: str, seqs, lr: float = 5e-2) -> list[float]:
    losses = []
    for seq in seqs:
        losses.append(backward(backend, model_id, 1))  # the same data every step: it is memorized
        backend.optim_step([optim(model_id, seq, DimuonParams(learning_rate=lr))])
    return losses


def test_dimuon_trains_and_load_state_resumes_it_bit_identically(base, tmp_path):
    backend = backend_with(base, {"m": dimuon(8, 0)}, max_adapters=4, max_rank=8)
    backend.checkpoint_dir = tmp_path
    losses = train(backend, "m", range(2, 12))
    assert losses[-1] < 0.8 * losses[0]
    save = Command("m", 20, Kind.SAVE_WEIGHTS, "m:20", payload=SaveRequest("dimuon-10"))
    path = backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"]
    first = train(backend, "m", range(21, 24))
    weights = backend.bank.weights[backend.adapters["m"].slot].clone()
    backend.load_checkpoint(Command("m", 30, Kind.LOAD_WEIGHTS, "m:30", payload=LoadRequest(path)))
    assert backend.adapters["m"].spec.optimizer == "dimuon"  # the family comes back with the checkpoint
    assert train(backend, "m", range(21, 24)) == first
    assert torch.equal(weights, backend.bank.weights[backend.adapters["m"].slot])


def test_a_step_of_the_other_family_fails_that_model_alone(base):
    backend = backend_with(base, {"d": dimuon(4, 0), "a": LoraSpec(rank=4, seed=1)}, max_adapters=4, max_rank=8)
    for model_id in ("d", "a"):
        backward(backend, model_id, 1)
    wrong, right = backend.optim_step([optim("d", 2, AdamParams()), optim("a", 2, AdamParams())])
    assert isinstance(wrong, InvalidRequestError) and "trains with dimuon" in str(wrong)
    assert right["metrics"]["grad_norm:mean"] > 0
    with pytest.raises(InvalidRequestError, match="learning_rate >= 0"):
        DimuonParams(learning_rate=-1.0)
