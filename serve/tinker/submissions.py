"""How a request becomes a future: recorded by the futures DB (durably, deduplicated by its seq) and handed as a
command to the trainer that runs it; and how a refused one still spends its seq."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, AsyncIterator, Awaitable, Callable

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from cluster.placement import named_actor
from cluster.unloading import failing_future
from lilo.engine.commands import Command, Kind
from lilo.errors import ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError, QuotaExceededError
from lilo.futures.billing import billed_tokens
from lilo.futures.store import Submission, SubmitOutcome
from lilo.tenants import tenant_of
from lilo.timing.traces import carrier, set_attributes
from serve.tinker.batched_calls import BatchedCalls
from serve.tinker.pushed_results import PushedResults


@dataclasses.dataclass(frozen=True)
class NewModel:
    """What the futures DB records of a model when its creation is first recorded."""

    base_model: str
    lora_config: dict
    session_id: str
    user_metadata: Any = None  # as the client sent it: checked when the model is recorded (``metadata_strings``)


def metadata_strings(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("user_metadata must be an object of strings.")
    return {str(key): str(value) for key, value in raw.items()}


# Hand-off calls one replica keeps in flight to one trainer (serve.tinker.batched_calls says why more than one).
HANDOFFS_IN_FLIGHT = 4


class Submissions:
    def __init__(self, futures: ActorHandle, pushed: PushedResults) -> None:
        self._futures = futures
        self._pushed = pushed  # where the results of what this replica submits come back (serve.tinker.pushed_results)
        # The requests that arrive together are recorded in one call, and handed to each trainer in one
        # (serve.tinker.batched_calls).
        self._records: BatchedCalls[Submission, SubmitOutcome] = BatchedCalls(
            lambda batch: futures.submit_once_many.remote(batch, pushed.subscriber))
        self._handoffs: dict[str, BatchedCalls[Command, None]] = {}

    def _hand_off(self, trainer: str, command: Command) -> Awaitable[None]:
        if trainer not in self._handoffs:
            self._handoffs[trainer] = BatchedCalls(lambda batch: named_actor(trainer).submit_many.remote(batch),
                                                   max_in_flight=HANDOFFS_IN_FLIGHT)
        return self._handoffs[trainer].call(command)

    async def submit(self, command: Command, stored: object, tenant: str | None) -> dict[str, str]:
        """Record ``command`` (``stored``: the payload fingerprinted for retries) and hand it to the trainer its model
        is placed on, which the futures DB says in the same call (404 unknown or another tenant's, 410 unloaded, 503
        while being restored elsewhere)."""
        request_id = await self.submit_to(Submission(command.model_id, command.kind, stored, seq_id=command.seq_id,
                                                     tenant=tenant, routed=True), command)
        return {"request_id": str(request_id), "model_id": command.model_id}

    async def submit_to(self, submission: Submission, command: Command) -> int:
        """Record ``submission`` (durably, deduplicated by its seq) and, unless it is a retry of a recorded one that
        has finished, hand ``command`` under its request id to its trainer (``submission.trainer``, or for a routed
        one the model's). Returns the request id."""
        traced = carrier()
        submission = dataclasses.replace(submission, tokens=command.tokens, trace=traced,
                                         billed_tokens=billed_tokens(command.kind, command.tokens,
                                                                     getattr(command.payload, "prompt", None))
                                         ).prepared()
        outcome = await self._records.call(submission)
        set_attributes(model_id=command.model_id, seq_id=command.seq_id, kind=str(command.kind),
                       tenant=tenant_of(submission.tenant), request_id=outcome.request_id,
                       duplicate=outcome.duplicate)
        if not outcome.duplicate or outcome.pending:
            self._pushed.submitted(outcome.request_id)
            command = dataclasses.replace(command, request_id=str(outcome.request_id),
                                          fingerprint=submission.payload_sha256, tenant=tenant_of(submission.tenant),
                                          weight=outcome.weight, trace=traced)
            # A refusal by the trainer (or its failure) also fails the recorded future.
            async with failing_future(self._futures, outcome.request_id, command.kind):
                await self._hand_off(outcome.trainer, command)
        return outcome.request_id

    @contextlib.asynccontextmanager
    async def spending_seq(self, model_id: str, seq_id: int, tenant: str | None) -> AsyncIterator[None]:
        """Checks of a seq'd request, refused with a 4xx before anything runs. The tinker SDK has spent ``seq_id`` on
        the request all the same, and sends the model's next one with the next seq_id; so a refusal is recorded under
        that seq as a ``Kind.REFUSED`` command, which the model's trainer fails in its turn, and the next request does
        not wait for this one forever. (Nothing is recorded when the model is unknown, another tenant's, or
        unloaded.)"""
        try:
            yield
        except (InvalidRequestError, NotFoundError, GoneError, QuotaExceededError) as refusal:
            with contextlib.suppress(LiloError, RayActorError):
                await self.submit_to(Submission(model_id, Kind.REFUSED, {"refused": str(refusal)}, seq_id=seq_id,
                                                tenant=tenant, routed=True),
                                     Command(model_id, seq_id, Kind.REFUSED, "", payload=str(refusal)))
            raise

    async def record_new_model(self, submission: Submission, model: NewModel,
                               start: Callable[[ActorHandle, str], Awaitable[None]]) -> dict[str, str]:
        """Record a model's creation as its seq 0 (a retry finds the first future instead of a second model) and,
        when it is new, add ``model`` on the submission's trainer and ``start`` it there; a failure on the way fails
        the future. (No trainer: the model exists already.) A retry of a creation still pending finishes it on the
        trainer its first attempt recorded, in case that attempt stopped half-way (its ingress died): the model's
        record is added if it is missing, and starting it again is a no-op on a trainer that has it."""
        chosen = submission.trainer
        submission = dataclasses.replace(submission, trace=carrier()).prepared()
        outcome = await self._futures.submit_once.remote(submission)
        set_attributes(model_id=submission.model_id, kind=str(submission.kind), tenant=tenant_of(submission.tenant),
                       request_id=outcome.request_id, duplicate=outcome.duplicate)
        if not outcome.duplicate or outcome.pending:
            async with failing_future(self._futures, outcome.request_id, submission.kind):
                if not outcome.duplicate and chosen is None:  # it exists, but its seq 0 was pruned long ago
                    raise ConflictError(f"Model {submission.model_id!r} already exists; create each model with the "
                                        "session's next model_seq_id.")
                trainer = outcome.trainer or chosen  # for a retry, the trainer its first attempt recorded
                if chosen is not None:  # no record of the model yet
                    await self._futures.add_model.remote(submission.model_id, model.base_model, model.lora_config,
                                                         tenant=submission.tenant, session_id=model.session_id,
                                                         trainer=trainer,
                                                         user_metadata=metadata_strings(model.user_metadata))
                await start(named_actor(trainer), str(outcome.request_id))
        return {"request_id": str(outcome.request_id), "model_id": submission.model_id}
