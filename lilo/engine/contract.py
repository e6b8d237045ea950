"""The backend contract: what the engine asks of a backend, and what a backend guarantees in return.

The engine speaks of models; a backend of adapters, each held in a slot. A model's adapter is keyed by its model
id. The engine maps its work onto the backend like this, and calls nothing else:

    engine                                      backend
    (the engine, once built)                ->  pass_ranks()
    create_model(model_id, spec)            ->  make_room([model_id], ...), then add_adapter(model_id, spec)
    any command of a model, before it runs  ->  make_room(its batch's models, ...) (pages them in)
    unload_model(model_id)                  ->  remove_adapter(model_id), once the model's queued commands have run
    Kind.FORWARD_BACKWARD, Kind.FORWARD     ->  forward_backward(commands, forward_only)
    Kind.OPTIM_STEP                         ->  optim_step(commands)
    Kind.SAMPLE                             ->  sample(commands)
    Kind.LOAD_WEIGHTS                       ->  load_checkpoint(command)
    Kind.SAVE_WEIGHTS, SAVE_WEIGHTS_FOR_SAMPLER, SAVE_WEIGHTS_EXTERNAL
                                            ->  capture_checkpoint(command), then persist_checkpoint(command, captured)
    Kind.REFUSED                            ->  nothing: the engine fails it with its message

Threads: the engine calls every method but ``persist_checkpoint`` and ``prefetch`` from its compute lane, one call
at a time; those two from its persist lane, possibly while the compute lane runs any other method.

Errors: a backend raises ``lilo.errors`` types for what the client can fix (``InvalidRequestError`` for bad input,
``NotFoundError`` for an adapter or checkpoint it does not hold, ``SaturatedError`` when its slots are full); any
other exception is the server's failure. The engine hands each command's exception to that command's future.

``TorchBackend`` implements this protocol; so does the engine tests' recording backend. ``contract_mismatches``
checks an implementation's methods and parameter names against it (``isinstance`` checks the names alone).
"""

from __future__ import annotations

import inspect
from typing import Callable, Collection, NotRequired, Protocol, Sequence, TypedDict, TypeVar, runtime_checkable

from lilo.backend.paging.policy import PageMove
from lilo.backend.types import AdamParams, DimuonParams, LoadRequest, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.engine.commands import Command

# What ``capture_checkpoint`` copies out and ``persist_checkpoint`` writes: the backend's own, opaque to the engine.
Captured = TypeVar("Captured")


class LossFnOutput(TypedDict):
    """One datum's outputs, one entry per input token."""

    logprobs: list[float]  # the target token's logprob
    elementwise_loss: list[float]  # the loss function's value (a weighted term of the datum's loss)


class ForwardBackwardResult(TypedDict):
    loss_fn_outputs: list[LossFnOutput]  # one per datum, in the request's order
    metrics: dict[str, float]  # "loss:sum": the request's loss, summed over its data


class OptimStepResult(TypedDict):
    metrics: dict[str, float]  # "grad_norm:mean": the model's gradient norm, before clipping


TopK = list[tuple[int, float]]  # (token id, logprob), likeliest first


class SampledSequence(TypedDict):
    tokens: list[int]
    logprobs: list[float]  # of each sampled token, under the temperature-scaled distribution
    stop_reason: str  # "stop" (a stop sequence or string ended it) or "length"
    topk_logprobs: NotRequired[list[TopK]]  # per sampled token, when topk_sample_logprobs asks


class TargetLogprobs(TypedDict):
    """``target_prompt_logprobs``' answer, in the layout of its question (dense, or CSR when the indices are set)."""

    shape: list[int]
    values: list[float]
    crow_indices: Sequence[int] | None
    col_indices: Sequence[int] | None


class AltTokens(TypedDict):
    """``prompt_alt_tokens_k`` draws at each prompt position after the first, with their logprobs."""

    k: int
    tokens: list[list[int]]
    logprobs: list[list[float]]


class SampleResult(TypedDict):
    sequences: list[SampledSequence]  # num_samples of them
    # Per prompt position; None for the first and for those before prompt_logprobs_last_n. Each only when asked.
    prompt_logprobs: NotRequired[list[float | None]]
    topk_prompt_logprobs: NotRequired[list[TopK | None]]
    target_prompt_logprobs: NotRequired[TargetLogprobs]
    prompt_alt_tokens: NotRequired[AltTokens]


class LoadResult(TypedDict):
    path: str  # the checkpoint loaded


class SaveResult(TypedDict):
    path: str  # the checkpoint's tinker:// path
    sampling_session_id: NotRequired[str]  # the sampling session the save opens, when its request named one


@runtime_checkable
class Backend(Protocol[Captured]):
    """The engine's only view of the model code.

    Batch methods (``forward_backward``, ``optim_step``, ``sample``) return one entry per command, in the commands'
    order: its result, or the exception that failed it alone while the others ran. A batch method may also raise:
    then every command of the batch fails with that error.
    """

    def add_adapter(self, model_id: str, spec: LoraSpec) -> None:
        """Put a fresh adapter for ``model_id`` in a free slot: A drawn at random (from ``spec.seed`` when it has
        one), B zero, optimizer state zero. Raises ``InvalidRequestError`` for a rank the backend cannot hold and
        ``SaturatedError`` when every slot for training models is taken."""
        ...

    def remove_adapter(self, model_id: str) -> None:
        """Free ``model_id``'s slot (an adapter added there later starts fresh); ``NotFoundError`` if it holds
        none."""
        ...

    def training_slots(self) -> int:
        """How many training models can be in slots at once: the engine runs a batch of more models in parts."""
        ...

    def pass_ranks(self) -> int:
        """How many processes run each pass: 1, or the ranks of a backend that spans several devices (each
        execution's timing says so)."""
        ...

    def make_room(self, model_ids: Sequence[str], running: Collection[str],
                  queued: Collection[str]) -> list[PageMove]:
        """Make every one of ``model_ids`` resident: one paged out comes back into a slot with its whole training
        state, bit for bit; for one not held yet (about to be added) a slot is freed. Room comes from paging out
        the resident models idle longest: never one in ``running`` or ``model_ids``, one in ``queued`` (it has
        work waiting) only when no other is left. Returns the moves, in order, for the engine's timing; raises
        ``SaturatedError`` when no tier has room, saying what to raise."""
        ...

    def prefetch(self, model_ids: Sequence[str]) -> list[PageMove]:
        """On the persist lane, while the compute lane runs: bring paged-out ``model_ids`` (the next to run) nearer
        to their slots (a page file read into memory), so their ``make_room`` is quicker; changes no slot and no
        model's state. Returns the moves, for the engine's timing."""
        ...

    def forward_backward(self, commands: Sequence[Command[TrainInput]],
                         forward_only: bool) -> list[ForwardBackwardResult | Exception]:
        """One pass over every command's data, each row through its own model's adapter. Unless ``forward_only``,
        each model's gradients accumulate in its slot until its next ``optim_step``; ``forward_only`` leaves every
        gradient as it was. A command's loss and gradients equal those of a pass over it alone, whatever else
        shares the batch (its rows touch only its slot; losses are per-datum sums). A command that fails
        validation (bad input, unknown model) gets its exception; the others run."""
        ...

    def optim_step(self, commands: Sequence[Command[AdamParams | DimuonParams]]) -> list[OptimStepResult | Exception]:
        """One step for every command's model with the optimizer family it was created with (AdamW or Dimuon),
        each with its own hyperparameters, then its gradients are zeroed; one model's step never depends on
        another's, and a model that is unknown, or whose settings are another family's, fails alone."""
        ...

    def sample(self, commands: Sequence[Command[SamplingRequest]],
               cancelled: Callable[[str], bool]) -> list[SampleResult | Exception]:
        """Every command's samples; ``model_id`` names a training model or a sampler checkpoint (its tinker path,
        loaded into a slot as needed), and a ``base_only`` request samples the bare base model. A request with a
        seed gets the same tokens whatever shares the batch. A batch sampling more checkpoints than there are
        slots runs as several generations; a checkpoint that can get no slot at all fails its command with
        ``SaturatedError``. A command whose request id ``cancelled`` names (its client cancelled it while it ran)
        may stop early: the engine fails it whatever it returns."""
        ...

    def load_checkpoint(self, command: Command[LoadRequest]) -> LoadResult:
        """Replace the model's adapter (its spec and weights) by a save_weights checkpoint's, with the checkpoint's
        optimizer state and step unless ``optimizer=False`` (then fresh ones). A load that fails part-way leaves
        the model as it was."""
        ...

    def capture_checkpoint(self, command: Command[SaveRequest]) -> Captured:
        """Copy the model's adapter (for ``Kind.SAVE_WEIGHTS`` with its optimizer state and step) out of its slot,
        on the compute lane: once this returns the model's next commands may change the slot while the copy is
        written. A name that is not allowed raises ``InvalidRequestError`` before anything is copied."""
        ...

    def persist_checkpoint(self, command: Command[SaveRequest], captured: Captured) -> SaveResult:
        """Write what ``capture_checkpoint`` copied, on the persist lane. When this returns the checkpoint's files
        are written whole; its marker file is written last (and a save under an existing name removes the old
        marker first), so a checkpoint cut short never passes for a complete one. The files are not fsynced."""
        ...


def contract_mismatches(implementation: type) -> list[str]:
    """What ``implementation`` lacks of the ``Backend`` protocol: each method it does not have, or has with other
    parameter names (an empty list: it implements the contract)."""
    mismatches = []
    for name in sorted(_contract_methods()):
        expected = list(inspect.signature(getattr(Backend, name)).parameters)
        method = getattr(implementation, name, None)
        if not callable(method):
            mismatches.append(f"{name} is missing")
            continue
        actual = list(inspect.signature(method).parameters)
        if actual != expected:
            mismatches.append(f"{name}({', '.join(actual)}) should be {name}({', '.join(expected)})")
    return mismatches


def _contract_methods() -> set[str]:
    return {name for name, value in vars(Backend).items() if inspect.isfunction(value) and not name.startswith("_")}

