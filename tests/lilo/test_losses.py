"""The RL losses against references written from their definitions (docs/losses.md), on small tensors: each loss's
value and its gradient with respect to the model's log-probabilities, and their config keys."""

import numpy as np
import pytest
import torch

from lilo.backend.training import losses
from lilo.backend.training.loss_inputs import CONFIG_KEYS, check_train_input, loss_config
from lilo.backend.provenance import RECORDED_LOGPROBS, RECORDED_MASK, PROMPT, SAMPLED, Provenance, Span
from lilo.backend.types import Datum, TrainInput
from lilo.errors import InvalidRequestError

RNG = np.random.default_rng(7)


def value_and_grad(loss_fn, logprobs: np.ndarray, inputs: dict, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loss, and d(sum of it)/d(logprobs), from the implementation under test."""
    x = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    tensors = {key: torch.tensor(value, dtype=torch.float64) for key, value in inputs.items()}
    per_token = loss_fn(x, tensors, config)
    per_token.sum().backward()
    return per_token.detach().numpy(), x.grad.numpy()


def gspo_reference(logprobs, sampler, advantages, mask, low, high):
    """The docs' GSPO-token objective, by hand: every token's ratio is the sequence ratio s (geometric mean of the
    token ratios over M); its gradient is s * d log p_t. The loss is -min(s A, clip(s) A); where the clipped term is
    strictly smaller (and the clip active), the token gets no gradient."""
    s = np.exp(np.mean((logprobs - sampler)[mask != 0]))
    clipped = np.clip(s, low, high)
    value = -np.minimum(s * advantages, clipped * advantages)
    clipped_wins = (clipped * advantages < s * advantages) & (clipped != s)
    grad = np.where(clipped_wins, 0.0, -s * advantages)
    return value, grad


@pytest.mark.parametrize("shift", [0.0, 0.05, -0.3, 1.0])
def test_gspo_matches_the_docs_formula(shift):
    n = 9
    sampler = RNG.normal(-2.0, 0.5, n)
    logprobs = sampler + shift + RNG.normal(0, 0.02, n)
    advantages = np.array([0, 0, 0, 1.5, 1.5, -0.7, -0.7, 2.0, 0.0])
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0], dtype=float)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    value, grad = value_and_grad(losses.gspo, logprobs, {"logprobs": sampler, "advantages": advantages,
                                                         "sequence_ratio_mask": mask}, config)
    expected_value, expected_grad = gspo_reference(logprobs, sampler, advantages, mask, 0.9, 1.1)
    np.testing.assert_allclose(value, expected_value, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_gspo_without_a_mask_takes_the_ratio_over_the_trained_tokens():
    sampler = RNG.normal(-1.0, 0.3, 6)
    logprobs = sampler + np.array([5.0, -5.0, 0.01, 0.02, 0.03, 0.0])  # the prompt positions drift wildly
    advantages = np.array([0, 0, 1.0, 1.0, 1.0, 0])
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    without = value_and_grad(losses.gspo, logprobs, {"logprobs": sampler, "advantages": advantages}, config)
    with_mask = value_and_grad(losses.gspo, logprobs, {"logprobs": sampler, "advantages": advantages,
                                                       "sequence_ratio_mask": (advantages != 0).astype(float)},
                               config)
    np.testing.assert_allclose(without, with_mask, rtol=1e-12)


def test_gspo_of_a_datum_with_no_trained_token_is_zero_not_nan():
    value, grad = value_and_grad(losses.gspo, np.array([-1.0, -2.0]),
                                 {"logprobs": np.array([-1.5, -2.5]), "advantages": np.zeros(2)},
                                 CONFIG_KEYS["gspo"])
    assert np.all(value == 0) and np.all(grad == 0)


@pytest.mark.parametrize("shift", [0.0, 0.2, 1.5, -1.0])
def test_stable_reinforce_matches_its_definition(shift):
    n = 8
    recorded = RNG.normal(-2.0, 0.5, n)
    logprobs = recorded + shift + RNG.normal(0, 0.05, n)
    advantages = RNG.normal(0, 1, n)
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 1], dtype=float)
    cap = 2.0
    inputs = {RECORDED_LOGPROBS: recorded * mask, RECORDED_MASK: mask, "advantages": advantages,
              # the client's own logprobs are ignored: garbage here changes nothing
              "logprobs": np.full(n, 123.0)}
    value, grad = value_and_grad(losses.stable_reinforce, logprobs, inputs, {"max_importance_weight": cap})
    weight = np.minimum(np.exp(logprobs - recorded), cap)
    np.testing.assert_allclose(value, -mask * weight * advantages * logprobs, rtol=1e-12)
    np.testing.assert_allclose(grad, -mask * weight * advantages, rtol=1e-12)


def test_config_keys_and_defaults_of_the_new_losses():
    assert loss_config("gspo", {}) == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert loss_config("stable_reinforce", {"max_importance_weight": 5}) == {"max_importance_weight": 5.0}
    with pytest.raises(InvalidRequestError, match="Unknown loss_fn_config key.*clip_low_threshold"):
        loss_config("stable_reinforce", {"clip_low_threshold": 0.8})


def test_stable_reinforce_needs_provenance_on_every_datum():
    plain = Datum(tokens=[1, 2, 3], loss_inputs={"target_tokens": [2, 3, 4], "advantages": [0.0, 1.0, 1.0]})
    spans = (Span(PROMPT, "7:0", 0, 1), Span(SAMPLED, "7:0", 0, 2))
    traced = Datum(tokens=plain.tokens, loss_inputs=plain.loss_inputs, provenance=Provenance(spans, spans))
    check_train_input(TrainInput([traced], loss_fn="stable_reinforce"))
    with pytest.raises(InvalidRequestError, match="Datum 1 has no provenance.*record_stability_info"):
        check_train_input(TrainInput([traced, plain], loss_fn="stable_reinforce"))
