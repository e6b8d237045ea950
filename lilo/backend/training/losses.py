"""Tinker's losses, per token. Each takes the model's log-probabilities of the target tokens (``logprobs``, with
gradient) and the datum's loss inputs, and returns the per-token loss; a datum's loss is the sum.

- ``cross_entropy``: ``-logprobs * weights``.
- ``importance_sampling``: ``-exp(logprobs - sampler_logprobs) * advantages`` (inputs ``logprobs``: the sampler's,
  ``advantages``).
- ``ppo``: ``-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)`` with ``r`` the ratio above
  (config ``clip_low_threshold`` default 0.8, ``clip_high_threshold`` default 1.2).
- ``cispo``: ``-stopgrad(clip(r, low, high)) * logprobs * A`` (same clip config).
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs) ** 2)`` (config ``beta``, default 0.05).
- ``gspo`` (GSPO-token, as Tinker's docs state it): the sequence ratio ``s = exp(mean over M of (logprobs -
  sampler_logprobs))``, M the positions ``sequence_ratio_mask`` marks (without it, those with a nonzero advantage);
  each token carries ``s``'s value with its own log-probability's gradient, ``s_t = sg(s) * exp(logprobs -
  sg(logprobs))``, and the loss is PPO's on it: ``-min(s_t * A, clip(s_t, low, high) * A)`` (config
  ``clip_low_threshold`` default 0.9997, ``clip_high_threshold`` default 1.0004: the GSPO paper's 3e-4 and 4e-4).
- ``stable_reinforce``: REINFORCE with a truncated, stop-gradient importance weight against what the sampler
  recorded: ``-m * sg(min(exp(logprobs - recorded_logprobs), max_importance_weight)) * A * logprobs``, where
  ``recorded_logprobs`` are the sampler's own logprobs of the sampled tokens (``record_stability_info``) and ``m``
  marks the targets that are sampled tokens (both resolved from the datum's provenance by the server; the client's
  ``logprobs`` input is not used). Config ``max_importance_weight``, default 2.0. See docs/losses.md for why this
  is lilo's definition.

The inputs each needs and its config keys are ``loss_inputs``, which checks a request before it runs. A ``custom``
loss is one the client uploaded (``loss_graph``): it returns a scalar loss per datum, and metrics, rather than a
per-token loss.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from lilo.backend.provenance import RECORDED_LOGPROBS, RECORDED_MASK
from lilo.backend.training.loss_graph import LossGraph, run_loss_graph
from lilo.backend.training.loss_inputs import CUSTOM
from lilo.backend.types import Datum
from lilo.errors import InvalidRequestError

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def _ratio(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logprobs - inputs["logprobs"])


def cross_entropy(logprobs, inputs, config):
    return -logprobs * inputs["weights"]


def importance_sampling(logprobs, inputs, config):
    return -_ratio(logprobs, inputs) * inputs["advantages"]


def ppo(logprobs, inputs, config):
    ratio = _ratio(logprobs, inputs)
    advantages = inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(logprobs, inputs, config):
    clipped = _ratio(logprobs, inputs).clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -clipped * logprobs * inputs["advantages"]


def dro(logprobs, inputs, config):
    drift = logprobs - inputs["logprobs"]
    return -(logprobs * inputs["advantages"] - config["beta"] / 2 * drift ** 2)


def gspo(logprobs, inputs, config):
    advantages = inputs["advantages"]
    in_ratio = (inputs["sequence_ratio_mask"] if "sequence_ratio_mask" in inputs else advantages) != 0
    drift = (logprobs.detach() - inputs["logprobs"])[in_ratio]
    # No position in the ratio (a datum with no trained token): s = 1, the mean of nothing is not taken.
    log_ratio = drift.mean() if drift.numel() else drift.new_zeros(())
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def stable_reinforce(logprobs, inputs, config):
    weight = torch.exp(logprobs.detach() - inputs[RECORDED_LOGPROBS]).clamp(max=config["max_importance_weight"])
    return -inputs[RECORDED_MASK] * weight * inputs["advantages"] * logprobs


def datum_loss(loss_fn: str, config: Mapping[str, float], custom_loss: LossGraph | None, logprobs: torch.Tensor,
               inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's (per-token loss, or None for a custom loss; its loss; a custom loss's metrics)."""
    if custom_loss is None:
        elementwise = LOSSES[loss_fn](logprobs, inputs, config)
        return elementwise, elementwise.sum(), {}
    loss, metrics = run_loss_graph(custom_loss, logprobs, inputs)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not all(
            isinstance(value, torch.Tensor) and value.ndim == 0 for value in metrics.values()):
        raise InvalidRequestError(f"Custom loss {custom_loss.name!r} must return a scalar tensor loss and scalar "
                                  "tensor metrics for each datum.")
    return None, loss, metrics


def check_custom_loss(custom_loss: LossGraph, data: Sequence[Datum]) -> None:
    """Run ``custom_loss`` once on zeros shaped like each datum, without gradient: a loss that does not fit its
    data (shapes, dtypes) fails its request alone here, not the pass it would share with others."""
    for index, datum in enumerate(data):
        targets = np.shape(datum.loss_inputs["target_tokens"])
        inputs = {key: torch.as_tensor(np.asarray(value, dtype=np.float32))
                  for key, value in datum.loss_inputs.items() if key != "target_tokens"}
        try:
            with torch.no_grad():
                datum_loss(CUSTOM, {}, custom_loss, torch.zeros(targets), inputs)
        except InvalidRequestError:
            raise
        except Exception as error:
            raise InvalidRequestError(f"Custom loss {custom_loss.name!r} failed on datum {index}: "
                                      f"{str(error).splitlines()[0][:300]}") from None


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo,
    "dro": dro, "gspo": gspo, "stable_reinforce": stable_reinforce,
}
