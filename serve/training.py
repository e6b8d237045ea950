"""The training half of the Tinker API, behind the HTTP routes: sessions, models and their placement, and
submissions that become futures and commands on the trainer that owns the model."""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any, Sequence

import ray
from ray.actor import ActorHandle

from cluster.local import NAMESPACE
from cluster.placement import choose_trainer
from lilo.backend.optimizer import AdamParams
from lilo.backend.types import LoadRequest, LoraSpec, SaveRequest
from lilo.engine.commands import FORWARD, FORWARD_BACKWARD, LOAD_WEIGHTS, OPTIM_STEP, Command
from lilo.errors import InvalidRequestError, LiloError, NotFoundError
from lilo.futures.store import Completion, Submission
from lilo.protocol.proto import ForwardBackwardCall

CREATE_MODEL = "create_model"
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:16]}"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    # The SDK computes this itself for create-via-load, so every model id follows it.
    return f"{session_id}:train:{model_seq_id}"


def lora_spec(lora_config: dict[str, Any]) -> LoraSpec:
    try:
        return LoraSpec(rank=int(lora_config["rank"]), seed=lora_config.get("seed"),
                        train_attn=bool(lora_config.get("train_attn", True)),
                        train_mlp=bool(lora_config.get("train_mlp", True)),
                        train_unembed=bool(lora_config.get("train_unembed", True)))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError("lora_config needs an integer rank (and optional seed, train_attn, train_mlp, "
                                  "train_unembed).") from None


def adam_params(raw: dict[str, Any]) -> AdamParams:
    unknown = sorted(set(raw) - set(ADAM_KEYS))
    if unknown:
        raise InvalidRequestError(f"Unknown adam_params key(s) {', '.join(unknown)}; known: {', '.join(ADAM_KEYS)}.")
    try:
        return AdamParams(**{key: float(value) for key, value in raw.items()})
    except (TypeError, ValueError):
        raise InvalidRequestError("adam_params values must be numbers.") from None


@functools.lru_cache(maxsize=None)
def named_actor(name: str) -> ActorHandle:
    """A handle to one of lilo's named actors, looked up once per process: each lookup is a blocking GCS round
    trip, which would stall this event loop on every request."""
    return ray.get_actor(name, namespace=NAMESPACE)


# model_id -> its trainer's name, as the futures DB placed it. A model stays on its trainer, so this saves the DB
# actor a call per submission; an entry is dropped when its trainer cannot be reached.
_owners: dict[str, str] = {}
MAX_CACHED_OWNERS = 100_000


async def trainer_for(futures: ActorHandle, model_id: str) -> ActorHandle:
    trainer = _owners.get(model_id)
    if trainer is None:
        trainer = await futures.trainer_of.remote(model_id)
        if trainer is None:
            raise NotFoundError(f"Unknown model_id {model_id!r}; pass the model_id that create_model returned.")
        if len(_owners) >= MAX_CACHED_OWNERS:
            _owners.clear()
        _owners[model_id] = trainer
    return named_actor(trainer)


async def place(futures: ActorHandle, trainers: Sequence[str], base_model: str) -> str:
    """A trainer for a new model: of those serving its base model, the least loaded with a free slot."""
    free = {}
    for name in trainers:
        info = await named_actor(name).ready.remote()
        if info["base_model"] == base_model:
            free[name] = info["free_slots"]
    placed: dict[str, int] = {}
    for trainer in (await futures.placement.remote()).values():
        placed[trainer] = placed.get(trainer, 0) + 1
    return choose_trainer(free, placed)


async def create_model(futures: ActorHandle, trainers: Sequence[str], body: dict[str, Any],
                       tenant: str | None) -> dict[str, str]:
    model_id = model_id_for(body["session_id"], int(body["model_seq_id"]))
    spec = lora_spec(body.get("lora_config") or {})
    # seq 0 of a model is its creation: a retried create_model finds its first future instead of a second model.
    outcome = await futures.submit_once.remote(
        Submission(model_id, CREATE_MODEL, {"base_model": body["base_model"], "lora": body.get("lora_config")},
                   seq_id=0, tenant=tenant).prepared())
    if not outcome.duplicate:
        trainer = await place(futures, trainers, body["base_model"])
        await futures.add_model.remote(model_id, body["base_model"], body.get("lora_config") or {},
                                       tenant=tenant, session_id=body["session_id"], trainer=trainer)
        await _hand_over(futures, outcome.request_id, CREATE_MODEL, named_actor(
            trainer).create_model_future.remote(model_id, spec, str(outcome.request_id)))
    return {"request_id": str(outcome.request_id), "model_id": model_id}


async def submit(futures: ActorHandle, model_id: str, seq_id: int, kind: str, payload: Any, stored: Any,
                 batch_key: Any = (), tokens: int = 0, tenant: str | None = None) -> dict[str, str]:
    """Record the request (durably, deduplicated by seq) and hand it to the model's trainer."""
    trainer = await trainer_for(futures, model_id)
    try:
        request_id = await submit_to(futures, trainer, Submission(model_id, kind, stored, seq_id=seq_id,
                                                                  tenant=tenant),
                                     Command(model_id, seq_id, kind, "", payload=payload, batch_key=batch_key,
                                             tokens=tokens))
    except ray.exceptions.RayActorError:
        _owners.pop(model_id, None)  # the next request asks the futures DB where the model lives now
        raise
    return {"request_id": str(request_id), "model_id": model_id}


async def submit_to(futures: ActorHandle, trainer: ActorHandle, submission: Submission, command: Command) -> int:
    """Record ``submission`` (durably, deduplicated by its seq) and, unless it is a retry of a recorded one, hand
    ``command`` to ``trainer`` under the new request id. Returns the request id."""
    submission = submission.prepared()
    outcome = await futures.submit_once.remote(submission)
    if not outcome.duplicate:
        command = dataclasses.replace(command, request_id=str(outcome.request_id),
                                      fingerprint=submission.payload_sha256)
        await _hand_over(futures, outcome.request_id, command.kind, trainer.submit.remote(command))
    return outcome.request_id


async def _hand_over(futures: ActorHandle, request_id: int, kind: str, handed: Any) -> None:
    """Await the trainer's acceptance; a refusal also fails the recorded future, so it never stays pending."""
    try:
        await handed
    except Exception as error:
        cause = getattr(error, "cause", None) or error
        category = "user" if isinstance(cause, LiloError) else "server"
        await futures.complete.remote([Completion.failure(request_id, str(cause), category, request_type=kind)])
        raise


async def submit_forward_backward(futures: ActorHandle, call: ForwardBackwardCall,
                                  tenant: str | None) -> dict[str, str]:
    train = call.train
    stored = {"loss_fn": train.loss_fn, "loss_config": dict(train.loss_config),
              "data": [{"tokens": d.tokens, "inputs": dict(d.loss_inputs)} for d in train.data]}
    kind = FORWARD if call.forward_only else FORWARD_BACKWARD
    batch_key = (train.loss_fn, tuple(sorted(train.loss_config.items())))
    return await submit(futures, call.model_id, call.seq_id, kind, train, stored, batch_key, train.tokens, tenant)


async def submit_optim_step(futures: ActorHandle, body: dict[str, Any], tenant: str | None) -> dict[str, str]:
    params = adam_params(body.get("adam_params") or {})
    return await submit(futures, body["model_id"], int(body["seq_id"]), OPTIM_STEP, params, body.get("adam_params"),
                        tenant=tenant)


async def submit_save(futures: ActorHandle, body: dict[str, Any], kind: str, tenant: str | None) -> dict[str, str]:
    name = body.get("path")
    if not name:
        raise InvalidRequestError(f"{kind} needs a path (the checkpoint's name).")
    return await submit(futures, body["model_id"], int(body["seq_id"]), kind, SaveRequest(str(name)),
                        {"path": name}, tenant=tenant)


async def submit_load(futures: ActorHandle, body: dict[str, Any], tenant: str | None) -> dict[str, str]:
    if not body.get("model_id") or body.get("seq_id") is None:
        raise InvalidRequestError("load_weights needs model_id and seq_id; creating a model by loading is not "
                                  "supported by this server yet (create_model, then load_weights).")
    request = LoadRequest(path=str(body["path"]), optimizer=bool(body.get("optimizer", True)))
    return await submit(futures, body["model_id"], int(body["seq_id"]), LOAD_WEIGHTS, request,
                        {"path": request.path, "optimizer": request.optimizer}, tenant=tenant)
