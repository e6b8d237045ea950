"""The training half of the Tinker API, behind the HTTP routes: sessions, models and their placement, and
submissions that become futures and commands on the trainer that holds the model."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from cluster.placement import named_actor, place
from cluster.unloading import failing_future, unload_models
from lilo.backend.checkpoint_index import WEIGHTS
from lilo.backend.checkpoint_paths import checked_client_name, parse_tinker_path, tinker_path
from lilo.backend.loss_inputs import NEEDS_PROVENANCE, check_train_input, with_recorded_inputs
from lilo.backend.provenance import named_sequences
from lilo.backend.types import AdamParams, LoadRequest, LoraSpec, SaveRequest
from lilo.engine.commands import Command, Kind
from lilo.errors import ConflictError, GoneError, InvalidRequestError, LiloError, NotFoundError
from lilo.futures.checkpoint_records import expiry_for
from lilo.futures.store import Submission
from lilo.protocol.proto import ForwardBackwardCall

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:16]}"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    # The SDK computes this itself for create-via-load, so every model id follows it.
    return f"{session_id}:train:{model_seq_id}"


def adam_params(raw: dict[str, Any]) -> AdamParams:
    unknown = sorted(set(raw) - set(ADAM_KEYS))
    if unknown:
        raise InvalidRequestError(f"Unknown adam_params key(s) {', '.join(unknown)}; known: {', '.join(ADAM_KEYS)}.")
    try:
        return AdamParams(**{key: float(value) for key, value in raw.items()})
    except (TypeError, ValueError):
        raise InvalidRequestError("adam_params values must be numbers.") from None


def user_metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("user_metadata must be an object of strings.")
    return {str(key): str(value) for key, value in raw.items()}


async def create_model(futures: ActorHandle, trainers: Sequence[str], body: dict[str, Any],
                       tenant: str | None) -> dict[str, str]:
    model_id = model_id_for(body["session_id"], int(body["model_seq_id"]))
    spec = LoraSpec.from_config(body.get("lora_config") or {})
    await futures.check_session.remote(body["session_id"], tenant)  # model ids are named after their session
    # A full cluster is a 429 the client may retry, with nothing recorded; a retry of a model already created
    # skips placement and finds its first future.
    trainer = (None if await futures.trainer_of.remote(model_id, tenant)
               else await place(futures, trainers, body["base_model"]))
    submission = Submission(model_id, Kind.CREATE_MODEL,
                            {"base_model": body["base_model"], "lora": body.get("lora_config")},
                            seq_id=0, tenant=tenant, trainer=trainer)
    return await _record_new_model(
        futures, submission, body, body.get("lora_config") or {},
        lambda actor, request_id: actor.create_model_future.remote(model_id, spec, request_id))


async def create_model_from_checkpoint(futures: ActorHandle, trainers: Sequence[str], body: dict[str, Any],
                                       tenant: str | None) -> dict[str, str]:
    """Create-via-load (the SDK's ``create_training_client_from_state[_with_optimizer]``): a new model
    ``{session_id}:train:{model_seq_id}`` on a trainer serving the checkpoint's base model, whose first command
    (seq 0, its creation) loads the checkpoint's adapter, and its optimizer state when ``optimizer`` is true. A
    retry finds the first future instead of a second model. The checkpoint is read by the trainer the new model is
    placed on: on a multi-node cluster, the checkpoint directory must be shared storage."""
    model_id = model_id_for(body["session_id"], int(body["model_seq_id"]))
    path = str(body["path"])
    _, kind, _ = parse_tinker_path(path)
    if kind != WEIGHTS:
        raise InvalidRequestError(f"{path!r} is not a training checkpoint; create a training client from a path "
                                  "save_state (save_weights) returned: tinker://<run>/weights/<name>.")
    await futures.check_session.remote(body["session_id"], tenant)
    base_model = (await checkpoint_run(futures, path, tenant))["base_model"]
    if body.get("base_model") not in (None, base_model):
        raise InvalidRequestError(f"{path!r} was trained on {base_model!r}; leave base_model out or pass that one.")
    if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
        raise InvalidRequestError("Only the adamw optimizer is served here; leave optimizer_config out.")
    request = LoadRequest(path=path, optimizer=bool(body.get("optimizer", True)))
    trainer, spec = None, LoraSpec()  # both stay unused when the model exists already
    if not await futures.trainer_of.remote(model_id):
        # Placed and checked before anything is recorded: a full cluster or a missing checkpoint is a plain 4xx.
        trainer = await place(futures, trainers, base_model)
        spec = await named_actor(trainer).weights_spec.remote(path)
    submission = Submission(model_id, Kind.LOAD_WEIGHTS, {"path": path, "optimizer": request.optimizer,
                                                     "base_model": base_model}, seq_id=0, tenant=tenant,
                            trainer=trainer).prepared()
    return await _record_new_model(
        futures, submission, {**body, "base_model": base_model}, dataclasses.asdict(spec),
        lambda actor, request_id: actor.create_model_from_checkpoint.remote(model_id, spec, Command(
            model_id, 0, Kind.LOAD_WEIGHTS, request_id, payload=request, fingerprint=submission.payload_sha256)))


async def checkpoint_run(futures: ActorHandle, path: str, tenant: str | None) -> dict[str, Any]:
    """The training run (model row) that saved the checkpoint ``path``: 404 unless ``tenant`` may read it (one of
    its own, or a published one), 410 once it expired."""
    run, _, _ = parse_tinker_path(path)
    try:
        return (await futures.readable_checkpoint.remote(path, tenant))[0]
    except NotFoundError:
        raise NotFoundError(f"No training run {run!r} here, so no checkpoint {path!r}; pass a path save_state "
                            "returned.") from None


async def _record_new_model(futures: ActorHandle, submission: Submission, body: dict[str, Any],
                            lora_config: dict[str, Any],
                            start: Callable[[ActorHandle, str], Awaitable[None]]) -> dict[str, str]:
    """Record a model's creation as its seq 0 (a retry finds the first future instead of a second model) and, when
    it is new, add the model on the submission's trainer and ``start`` it there; a failure on the way fails the
    future. (No trainer: the model exists already.) A retry of a creation still pending finishes it on the trainer
    its first attempt recorded, in case that attempt stopped half-way (its ingress died): the model's record is
    added if it is missing, and starting it again is a no-op on a trainer that has it."""
    chosen = submission.trainer
    submission = submission.prepared()
    outcome = await futures.submit_once.remote(submission)
    if not outcome.duplicate or outcome.pending:
        async with failing_future(futures, outcome.request_id, submission.kind):
            if not outcome.duplicate and chosen is None:  # it exists, but its seq 0 was pruned long ago
                raise ConflictError(f"Model {submission.model_id!r} already exists; create each model with the "
                                    "session's next model_seq_id.")
            trainer = outcome.trainer or chosen  # for a retry, the trainer its first attempt recorded
            if chosen is not None:  # no record of the model yet
                await futures.add_model.remote(submission.model_id, body["base_model"], lora_config,
                                               tenant=submission.tenant, session_id=body["session_id"],
                                               trainer=trainer, user_metadata=user_metadata(body.get("user_metadata")))
            await start(named_actor(trainer), str(outcome.request_id))
    return {"request_id": str(outcome.request_id), "model_id": submission.model_id}


async def finish_session(futures: ActorHandle, session_id: str, tenant: str | None) -> None:
    """The client closed its ServiceClient, and its training clients with it (the SDK has no way to reach a model
    from another one): unload the session's models, so their adapter slots are free again once what they queued
    has run. A model that cannot be unloaded now is left as it is: a close must not fail."""
    model_ids = await futures.session_models.remote(session_id, tenant)
    await unload_models(futures, [(model_id, tenant) for model_id in model_ids], None,
                        f"session {session_id} finished")


async def submit(futures: ActorHandle, model_id: str, seq_id: int, kind: Kind, payload: Any, stored: Any,
                 batch_key: Any = (), tokens: int = 0, tenant: str | None = None) -> dict[str, str]:
    """Record the request (durably, deduplicated by seq) and hand it to the trainer its model is placed on, which
    the futures DB says in the same call (404 unknown or another tenant's, 410 unloaded, 503 while being restored elsewhere)."""
    request_id = await submit_to(futures, Submission(model_id, kind, stored, seq_id=seq_id, tenant=tenant,
                                                     routed=True),
                                 Command(model_id, seq_id, kind, "", payload=payload, batch_key=batch_key,
                                         tokens=tokens))
    return {"request_id": str(request_id), "model_id": model_id}


async def submit_to(futures: ActorHandle, submission: Submission, command: Command) -> int:
    """Record ``submission`` (durably, deduplicated by its seq) and, unless it is a retry of a recorded one that has
    finished, hand ``command`` under its request id to its trainer (``submission.trainer``, or for a routed one the
    model's). Returns the request id."""
    submission = submission.prepared()
    outcome = await futures.submit_once.remote(submission)
    if not outcome.duplicate or outcome.pending:
        command = dataclasses.replace(command, request_id=str(outcome.request_id),
                                      fingerprint=submission.payload_sha256)
        # A refusal by the trainer (or its failure) also fails the recorded future.
        async with failing_future(futures, outcome.request_id, command.kind):
            await named_actor(outcome.trainer).submit.remote(command)
    return outcome.request_id


@contextlib.asynccontextmanager
async def spending_seq(futures: ActorHandle, model_id: str, seq_id: int, tenant: str | None) -> AsyncIterator[None]:
    """Checks of a seq'd request, refused with a 4xx before anything runs. The tinker SDK has spent ``seq_id`` on the
    request all the same, and sends the model's next one with the next seq_id; so a refusal is recorded under that
    seq as a ``Kind.REFUSED`` command, which the model's trainer fails in its turn, and the next request does not wait
    for this one forever. (Nothing is recorded when the model is unknown, another tenant's, or unloaded.)"""
    try:
        yield
    except (InvalidRequestError, NotFoundError, GoneError) as refusal:
        with contextlib.suppress(LiloError, RayActorError):
            await submit_to(futures, Submission(model_id, Kind.REFUSED, {"refused": str(refusal)}, seq_id=seq_id,
                                                tenant=tenant, routed=True),
                            Command(model_id, seq_id, Kind.REFUSED, "", payload=str(refusal)))
        raise


async def submit_forward_backward(futures: ActorHandle, call: ForwardBackwardCall,
                                  tenant: str | None) -> dict[str, str]:
    train = call.train
    # Stored (fingerprinted) as the client sent it: a retry is compared with what it sent, not with the records.
    stored = {"loss_fn": train.loss_fn, "loss_config": dict(train.loss_config),
              "data": [{"tokens": d.tokens, "inputs": dict(d.loss_inputs), "provenance": d.provenance and dataclasses.asdict(d.provenance)}
                       for d in train.data]}
    async with spending_seq(futures, call.model_id, call.seq_id, tenant):
        check_train_input(train)
        if train.loss_fn in NEEDS_PROVENANCE:
            records = await futures.recorded_sequences.remote(
                call.model_id, named_sequences(d.provenance for d in train.data), tenant)
            train = with_recorded_inputs(train, records)
    kind = Kind.FORWARD if call.forward_only else Kind.FORWARD_BACKWARD
    batch_key = (train.loss_fn, tuple(sorted(train.loss_config.items())))
    return await submit(futures, call.model_id, call.seq_id, kind, train, stored, batch_key, train.tokens, tenant)


async def submit_optim_step(futures: ActorHandle, body: dict[str, Any], tenant: str | None) -> dict[str, str]:
    async with spending_seq(futures, body["model_id"], int(body["seq_id"]), tenant):
        params = adam_params(body.get("adam_params") or {})
    return await submit(futures, body["model_id"], int(body["seq_id"]), Kind.OPTIM_STEP, params,
                        body.get("adam_params"), tenant=tenant)


async def submit_save(futures: ActorHandle, body: dict[str, Any], kind: Kind, tenant: str | None) -> dict[str, str]:
    """A named save (``save_weights``, ``save_weights_for_sampler`` or ``save_weights_external``); its ``ttl_seconds``
    (none: never) is recorded as the checkpoint's expiry once the save is accepted."""
    name = body.get("path")
    async with spending_seq(futures, body["model_id"], int(body["seq_id"]), tenant):
        if not name:
            raise InvalidRequestError(f"{kind} needs a path (the checkpoint's name).")
        # Refused now: no name that could escape the checkpoint directory reaches a trainer.
        checked_client_name(name, kind)
        expires_at = expiry_for(body.get("ttl_seconds"), time.time())
        if body.get("age_encryption_recipients"):
            raise InvalidRequestError("lilo does not encrypt exported weights (its links are signed and expire); "
                                      "leave age_encryption_recipients out.")
    submitted = await submit(futures, body["model_id"], int(body["seq_id"]), kind, SaveRequest(str(name)),
                             {"path": name}, tenant=tenant)
    await futures.record_checkpoint_save.remote(tinker_path(body["model_id"], kind, name), tenant, expires_at)
    return submitted


async def submit_load(futures: ActorHandle, body: dict[str, Any], tenant: str | None) -> dict[str, str]:
    """load_weights into an existing model, in its seq order (the legacy form, with model_id and seq_id), from a
    checkpoint of one of the caller's runs."""
    request = LoadRequest(path=str(body["path"]), optimizer=bool(body.get("optimizer", True)))
    async with spending_seq(futures, body["model_id"], int(body["seq_id"]), tenant):
        await checkpoint_run(futures, request.path, tenant)
    return await submit(futures, body["model_id"], int(body["seq_id"]), Kind.LOAD_WEIGHTS, request,
                        {"path": request.path, "optimizer": request.optimizer}, tenant=tenant)
