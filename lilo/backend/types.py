"""The backend's own input types: the Tinker wire format is decoded into these at the edge."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Mapping, Sequence

import numpy as np

from lilo.backend.provenance import Provenance
from lilo.backend.training.loss_graph import LossGraph
from lilo.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    alpha: float | None = None  # None: alpha = rank, so the delta's scale is 1
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    seed: int | None = None
    # Its optimizer family, for all its life (OPTIMIZERS): chosen at creation, kept by its checkpoints.
    optimizer: str = "adamw"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "LoraSpec":
        """A client's ``lora_config`` (Tinker's defaults: every target trained), or a stored spec."""
        rank, seed = config.get("rank"), config.get("seed")
        # Checked, not left to int(): 4.7 would become rank 4, and a float seed failed torch on the trainer.
        malformed = InvalidRequestError("lora_config needs an integer rank (and optional integer seed, numeric "
                                        "alpha, train_attn, train_mlp, train_unembed).")
        if not is_int(rank) or not (seed is None or is_int(seed)):
            raise malformed
        optimizer = config.get("optimizer", "adamw")
        if optimizer not in OPTIMIZERS:
            raise InvalidRequestError(f"Unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}.")
        try:
            alpha = config.get("alpha")
            return cls(rank=rank, alpha=None if alpha is None else float(alpha), seed=seed,
                       train_attn=bool(config.get("train_attn", True)), train_mlp=bool(config.get("train_mlp", True)),
                       train_unembed=bool(config.get("train_unembed", True)), optimizer=optimizer)
        except (TypeError, ValueError):
            raise malformed from None

    def targets(self) -> tuple[str, ...]:
        """The LoraConfig targets it trains: ``attn``, ``mlp``, ``unembed``."""
        return tuple(target for target, asked in (("attn", self.train_attn), ("mlp", self.train_mlp),
                                                  ("unembed", self.train_unembed)) if asked)


def is_int(value: Any) -> bool:
    """An integer as a client sent it: JSON's true and false are Python bools, which are ints too."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Datum:
    """One sequence: the input tokens and, per position, what the loss needs (``target_tokens``, ``weights``,
    ``logprobs``, ``advantages``...), each as long as the input."""

    tokens: Sequence[int] | np.ndarray
    loss_inputs: Mapping[str, Sequence[float] | np.ndarray]
    # Which sampled sequence each token came from (``Datum.with_provenance``); only losses that need what the
    # sampler recorded read it.
    provenance: Provenance | None = None
    # Its images, in order; their positions in ``tokens`` hold the base model's image token.
    images: tuple[DatumImage, ...] = ()


@dataclasses.dataclass(frozen=True)
class DatumImage:
    """An image of a datum (or a prompt): its bytes as sent (PNG or JPEG), and the ``tokens`` positions from
    ``offset`` it stands for (what the client said it expects, until the ingress has counted them)."""

    data: bytes
    format: str
    offset: int
    tokens: int | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclasses.dataclass(frozen=True)
class TrainInput:
    data: Sequence[Datum]
    loss_fn: str = "cross_entropy"
    loss_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # loss_fn "custom": the stored loss its loss_config's loss_id names, resolved by the ingress.
    custom_loss: LossGraph | None = None

    @property
    def tokens(self) -> int:
        return sum(len(datum.tokens) for datum in self.data)


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """``save_weights`` (adapter + optimizer) or ``save_weights_for_sampler`` (PEFT adapter), by the command's kind."""

    name: str
    # The sampling session an ephemeral sampler save opens (the SDK's save_weights_and_get_sampling_client).
    sampling_session_id: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    path: str
    optimizer: bool = True


@dataclasses.dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping

    def __post_init__(self) -> None:
        if not (self.learning_rate >= 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0
                and self.weight_decay >= 0 and self.grad_clip_norm >= 0):
            raise InvalidRequestError(
                f"Invalid AdamParams {self}: use learning_rate >= 0, 0 <= beta1, beta2 < 1, eps > 0, "
                "weight_decay >= 0 and grad_clip_norm >= 0.")


@dataclasses.dataclass(frozen=True)
class DimuonParams:
    """One Dimuon step's settings (lilo.backend.adapters.dimuon says the rule)."""

    learning_rate: float
    grad_clip_norm: float = 0.0  # <= 0: no clipping
    beta1: float = 0.9

    def __post_init__(self) -> None:
        if not (self.learning_rate >= 0 and 0 <= self.beta1 < 1 and math.isfinite(self.grad_clip_norm)):
            raise InvalidRequestError(f"Invalid DimuonParams {self}: use learning_rate >= 0, 0 <= beta1 < 1 and a "
                                      "finite grad_clip_norm.")


# The optimizer families a model may train with: LoraSpec.optimizer, and the step parameters each takes.
OPTIMIZERS = {"adamw": AdamParams, "dimuon": DimuonParams}


@dataclasses.dataclass(frozen=True)
class PromptTargets:
    """``target_prompt_logprobs``: token ids to score at each prompt position after the first, a (positions, K)
    tensor with -1 where nothing is asked; dense (``values`` row-major) or sparse CSR (``values`` of the listed cells,
    the others -1). The answer keeps this layout."""

    shape: tuple[int, int]
    values: Sequence[int]
    crow_indices: Sequence[int] | None = None
    col_indices: Sequence[int] | None = None

    def value_rows(self) -> np.ndarray:
        """The row (prompt position after the first) of each value, in their order."""
        counts = np.diff(self.crow_indices) if self.crow_indices is not None else np.full(self.shape[0], self.shape[1])
        return np.repeat(np.arange(self.shape[0]), counts)


@dataclasses.dataclass(frozen=True)
class SamplingRequest:
    prompt: Sequence[int]
    max_tokens: int = 16
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[Sequence[int]] = ()  # token-id sequences that end a sample
    stop_strings: Sequence[str] = ()  # text that ends a sample (needs the base model's tokenizer)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None  # score only the prompt's last N tokens (None: every one after the first)
    topk_prompt_logprobs: int = 0  # the k likeliest tokens, with logprobs, at each scored prompt position (0: none)
    topk_sample_logprobs: int = 0  # the same at each sampled position
    target_prompt_logprobs: PromptTargets | None = None  # given tokens' logprobs at each prompt position
    prompt_alt_tokens_k: int = 0  # draws (at the temperature) from each prompt position's next-token distribution
    base_only: bool = False  # the bare base model, no adapter (the request named only a base model)
    # Record each returned sequence (prompt, tokens, logprobs) for training with stable_reinforce.
    record_stability_info: bool = False
    # The prompt's images, in order; their positions in ``prompt`` hold the base model's image token.
    images: tuple[DatumImage, ...] = ()

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill's logits answer something about the prompt itself (such a request may sample no
        token: a prompt that fills the context is still scored)."""
        return (self.prompt_logprobs or self.topk_prompt_logprobs > 0 or self.prompt_alt_tokens_k > 0
                or self.target_prompt_logprobs is not None)
