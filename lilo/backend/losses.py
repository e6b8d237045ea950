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

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from lilo.backend.types import Datum, TrainInput
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


def check_train_input(train: TrainInput, vocab_size: int | None = None) -> tuple[LossFn, dict[str, float]]:
    """The request's loss and full config, once its data is fit to run; else the client's mistake, said plainly.
    Without ``vocab_size`` (the ingress, before it knows the model's base) token ids are not checked against it."""
    if not train.data:
        raise InvalidRequestError("The request has no data; send at least one datum.")
    loss_fn, config = resolve(train.loss_fn, train.loss_config)
    for index, datum in enumerate(train.data):
        _check_datum(index, datum, REQUIRED_INPUTS[train.loss_fn], vocab_size)
    return loss_fn, config


def _check_datum(index: int, datum: Datum, required: Sequence[str], vocab_size: int | None) -> None:
    length = len(datum.tokens)
    if length == 0:
        raise InvalidRequestError(f"Datum {index} has no tokens; send at least one input token.")
    missing = [key for key in required if key not in datum.loss_inputs]
    if missing:
        raise InvalidRequestError(f"Datum {index} lacks loss input(s) {', '.join(missing)}.")
    for key, values in datum.loss_inputs.items():
        if len(values) != length:
            raise InvalidRequestError(
                f"Datum {index}: {key} has {len(values)} entries but the input has {length} tokens; make them equal.")
        if key != "target_tokens" and not np.isfinite(np.asarray(values, dtype=np.float64)).all():
            raise InvalidRequestError(f"Datum {index}: {key} holds NaN or infinite values; send finite numbers.")
    for key, values in (("tokens", datum.tokens), ("target_tokens", datum.loss_inputs["target_tokens"])):
        array = np.asarray(values)
        if array.min() < 0 or (vocab_size is not None and array.max() >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "(negative ids)"
            raise InvalidRequestError(
                f"Datum {index}: {key} holds ids outside the vocabulary {bound}; check the tokenizer.")
