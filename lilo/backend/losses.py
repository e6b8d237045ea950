"""Tinker's losses, per token. Each takes the model's log-probabilities of the target tokens (``logprobs``, with
gradient) and the datum's loss inputs, and returns the per-token loss; a datum's loss is the sum.

- ``cross_entropy``: ``-logprobs * weights``.
- ``importance_sampling``: ``-exp(logprobs - sampler_logprobs) * advantages`` (inputs ``logprobs``: the sampler's,
  ``advantages``).
- ``ppo``: ``-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)`` with ``r`` the ratio above
  (config ``clip_low_threshold`` default 0.8, ``clip_high_threshold`` default 1.2).
- ``cispo``: ``-stopgrad(clip(r, low, high)) * logprobs * A`` (same clip config).
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs) ** 2)`` (config ``beta``, default 0.05).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from lilo.errors import InvalidRequestError

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]

REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
CONFIG_KEYS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}


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


def resolve(loss_fn: str, config: Mapping[str, float]) -> tuple[LossFn, dict[str, float]]:
    """The loss and its full config; an unknown loss or config key is the client's mistake, said plainly."""
    if loss_fn not in LOSSES:
        raise InvalidRequestError(f"Unknown loss_fn {loss_fn!r}; use one of {', '.join(LOSSES)}.")
    defaults = CONFIG_KEYS[loss_fn]
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise InvalidRequestError(f"Unknown loss_fn_config key(s) {', '.join(unknown)} for {loss_fn}; known: {known}.")
    return LOSSES[loss_fn], {**defaults, **{key: float(value) for key, value in config.items()}}
