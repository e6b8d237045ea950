"""What each Tinker loss needs and takes, and the check that a training request fits it: without torch, so the API
front refuses a malformed request (4xx) before recording it. The losses themselves are ``losses``."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from lilo.backend.provenance import RecordedSequence, recorded_inputs
from lilo.backend.training.loss_graph import check_loss_inputs
from lilo.backend.types import Datum, TrainInput
from lilo.errors import InvalidRequestError

REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    # The sampler's logprobs come from its records (the datum's provenance), not from the client.
    "stable_reinforce": ("target_tokens", "advantages"),
    # A loss the server stores (lilo.backend.training.loss_graph): the inputs it declares are checked with it.
    "custom": ("target_tokens",),
}
CUSTOM = "custom"
# The inputs that may carry K values per token, shape (tokens, K), by loss: cross_entropy's top-K form (Tinker's
# "Top-K distillation": the loss is -sum_t sum_k w[t,k] log p(x[t,k]), and its logprobs come back (tokens, K)).
TOP_K_INPUTS = {"cross_entropy": ("target_tokens", "weights")}
# Losses computed against what the sampler recorded: their data must carry provenance, resolved before they run.
NEEDS_PROVENANCE = frozenset({"stable_reinforce"})
CONFIG_KEYS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    "stable_reinforce": {"max_importance_weight": 2.0},
}


def loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """The loss's full config; an unknown loss or config key is the client's mistake, said plainly."""
    if loss_fn not in CONFIG_KEYS:
        raise InvalidRequestError(f"Unknown loss_fn {loss_fn!r}; use one of {', '.join(CONFIG_KEYS)}.")
    defaults = CONFIG_KEYS[loss_fn]
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise InvalidRequestError(f"Unknown loss_fn_config key(s) {', '.join(unknown)} for {loss_fn}; known: {known}.")
    try:
        values = {key: float(value) for key, value in config.items()}
    except (TypeError, ValueError):
        raise InvalidRequestError(f"loss_fn_config values must be numbers; got {dict(config)!r}.") from None
    if not all(math.isfinite(value) for value in values.values()):
        raise InvalidRequestError(f"loss_fn_config values must be finite numbers; got {dict(config)!r}.")
    return {**defaults, **values}


def check_train_input(train: TrainInput, vocab_size: int | None = None) -> dict[str, float]:
    """The request's full loss config, once its data is fit to run; else the client's mistake, said plainly.
    Without ``vocab_size`` (the ingress, before it knows the model's base) token ids are not checked against it."""
    if not train.data:
        raise InvalidRequestError("The request has no data; send at least one datum.")
    config = _custom_loss_config(train) if train.loss_fn == CUSTOM else loss_config(train.loss_fn, train.loss_config)
    for index, datum in enumerate(train.data):
        _check_datum(index, datum, train.loss_fn, vocab_size)
        if train.loss_fn in NEEDS_PROVENANCE and datum.provenance is None:
            raise InvalidRequestError(
                f"Datum {index} has no provenance, which {train.loss_fn} needs: sample with "
                "record_stability_info=True and attach each datum's sequence_ids with Datum.with_provenance.")
    return config


def _custom_loss_config(train: TrainInput) -> dict[str, float]:
    """A custom loss takes no config but the id of the stored loss (which the ingress resolved into
    ``custom_loss``); its data must hold each input the loss declares, at its rank."""
    if train.custom_loss is None or set(train.loss_config) - {"loss_id"}:
        raise InvalidRequestError("loss_fn 'custom' runs a loss stored on the server: create it with "
                                  "ServiceClient.create_custom_loss and pass its handle to forward_backward_custom "
                                  "(loss_fn_config holds only its loss_id).")
    check_loss_inputs(train.custom_loss, [{key: np.shape(values) for key, values in datum.loss_inputs.items()}
                                          for datum in train.data])
    return {}


def with_recorded_inputs(train: TrainInput, records: Mapping[str, RecordedSequence]) -> TrainInput:
    """``train`` with each datum's loss inputs completed from the sampler's records its provenance names."""
    data = [dataclasses.replace(datum, loss_inputs={
        **datum.loss_inputs,
        **recorded_inputs(index, np.asarray(datum.tokens), np.asarray(datum.loss_inputs["target_tokens"]),
                          datum.provenance, records)})
            for index, datum in enumerate(train.data)]
    return dataclasses.replace(train, data=data)


def _check_datum(index: int, datum: Datum, loss_fn: str, vocab_size: int | None) -> None:
    length = len(datum.tokens)
    if length == 0:
        raise InvalidRequestError(f"Datum {index} has no tokens; send at least one input token.")
    missing = [key for key in REQUIRED_INPUTS[loss_fn] if key not in datum.loss_inputs]
    if missing:
        raise InvalidRequestError(f"Datum {index} lacks loss input(s) {', '.join(missing)}.")
    for key, values in datum.loss_inputs.items():
        per_datum = loss_fn == CUSTOM and np.ndim(values) == 0  # a scalar a custom loss declared (rank 0)
        if not per_datum and len(values) != length:
            raise InvalidRequestError(
                f"Datum {index}: {key} has {len(values)} entries but the input has {length} tokens; make them equal.")
        if key != "target_tokens" and not np.isfinite(np.asarray(values, dtype=np.float64)).all():
            raise InvalidRequestError(f"Datum {index}: {key} holds NaN or infinite values; send finite numbers.")
    if loss_fn != CUSTOM:  # a custom loss declares each input's rank itself
        _check_top_k(index, datum, loss_fn)
    for key, values in (("tokens", datum.tokens), ("target_tokens", datum.loss_inputs["target_tokens"])):
        array = np.asarray(values)
        if array.min() < 0 or (vocab_size is not None and array.max() >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "(negative ids)"
            raise InvalidRequestError(
                f"Datum {index}: {key} holds ids outside the vocabulary {bound}; check the tokenizer.")


def _check_top_k(index: int, datum: Datum, loss_fn: str) -> None:
    """Inputs of K values per token only where the loss defines them, and then all of its top-K inputs alike."""
    shapes = {key: np.shape(values) for key, values in datum.loss_inputs.items()}
    top_k = TOP_K_INPUTS.get(loss_fn, ())
    for key, shape in shapes.items():
        if len(shape) == 1:
            continue
        if len(shape) != 2 or key not in top_k:
            takes = (f"only its {' and '.join(top_k)} take K values per token" if top_k
                     else "it takes one value per token")
            raise InvalidRequestError(f"Datum {index}: {key} has shape {list(shape)}, but {loss_fn} defines no such "
                                      f"input ({takes}); send one value per token.")
    paired = {shapes[key] for key in top_k}
    if len(paired) > 1:
        described = " and ".join(f"{key} {list(shapes[key])}" for key in top_k)
        raise InvalidRequestError(f"Datum {index}: {described} differ in shape; for top-K {loss_fn} send both as "
                                  "(tokens, K), else both with one value per token.")
