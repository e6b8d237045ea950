"""Tinker's losses, per token. Each takes the model's log-probabilities of the target tokens (``logprobs``, with
gradient) and the datum's loss inputs, and returns the per-token loss; a datum's loss is the sum.

- ``cross_entropy``: ``-logprobs * weights``.
- ``importance_sampling``: ``-exp(logprobs - sampler_logprobs) * advantages`` (inputs ``logprobs``: the sampler's,
  ``advantages``).
- ``ppo``: ``-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)`` with ``r`` the ratio above
  (config ``clip_low_threshold`` default 0.8, ``clip_high_threshold`` default 1.2).
- ``cispo``: ``-stopgrad(clip(r, low, high)) * logprobs * A`` (same clip config).
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs) ** 2)`` (config ``beta``, default 0.05).

The inputs each needs and its config keys are ``loss_inputs``, which checks a request before it runs.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

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


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo,
    "dro": dro,
}
