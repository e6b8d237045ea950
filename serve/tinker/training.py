"""The training half of the Tinker API, behind the HTTP routes: sessions, models and their placement, and the
training steps, each recorded as a future and run as a command on the trainer that holds the model."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

from ray.actor import ActorHandle

from cluster.placement import trainer_facts
from cluster.unloading import unload_model, unload_models
from lilo.backend.registry import base_model_spec, check_context, split_context_suffix
from lilo.backend.checkpoints.index import WEIGHTS
from lilo.backend.checkpoints.paths import checked_client_name, parse_tinker_path, tinker_path
from lilo.backend.training.loss_inputs import NEEDS_PROVENANCE, check_train_input, with_recorded_inputs
from lilo.backend.provenance import named_sequences
from lilo.backend.types import LoadRequest, LoraSpec, SaveRequest
from lilo.engine.commands import Command, Kind
from lilo.errors import InvalidRequestError, QuotaExceededError
from lilo.futures.checkpoint_records import expiry_for
from lilo.futures.store import Submission, unloaded_error
from lilo.protocol.proto import ForwardBackwardCall
from serve.tinker.actors import ANSWER_WITHIN_S, Actors
from serve.tinker.custom_losses import CustomLosses
from serve.tinker.optimizers import optimizer_family, step_params
from serve.tinker.images import has_images, image_fingerprints, with_images_laid_out
from serve.tinker.requests import (
    Body, CreateModelRequest, FinishSessionRequest, LoadWeightsRequest, ModelRequest, OptimStepRequest,
    SaveWeightsRequest,
)
from serve.tinker.submissions import NewModel, Submissions

def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:16]}"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    # The SDK computes this itself for create-via-load, so every model id follows it.
    return f"{session_id}:train:{model_seq_id}"


class Training:
    """Sessions, models and training steps of the caller's tenant (another tenant's answer 404 like unknown ones)."""

    def __init__(self, actors: Actors, submissions: Submissions, base_models: Sequence[str],
                 storage_bytes: Callable[[str], Awaitable[int]]) -> None:
        self._actors = actors
        self.custom_losses = CustomLosses(actors)
        self._futures = actors.futures
        self._submissions = submissions
        self._base_models = list(base_models)
        self._storage_bytes = storage_bytes  # a tenant's checkpoints' bytes (Runs.storage_bytes)

    async def create_session(self, request: Body, tenant: str) -> dict[str, Any]:
        session_id = new_session_id()
        # What the client sent (tags, user_metadata, its SDK's extras) is the session's record, as sent.
        await self._futures.add_session.remote(session_id, tenant=tenant, info=request.model_dump())
        return {"session_id": session_id, "type": "create_session"}

    async def finish_session(self, session_id: str, request: FinishSessionRequest | None, tenant: str) -> None:
        """The client closed its ServiceClient, and its training clients with it (the SDK has no way to reach a
        model from another one): record why, and unload the session's models, so their adapter slots are free again
        once what they queued has run. A model that cannot be unloaded now is left as it is: a close must not
        fail."""
        finished = request or FinishSessionRequest()
        await self._futures.record_session_finish.remote(session_id, tenant,
                                                         {"reason": finished.reason, "detail": finished.detail})
        model_ids = await self._futures.session_models.remote(session_id, tenant)
        await unload_models(self._futures, [(model_id, tenant) for model_id in model_ids], None,
                            f"session {session_id} finished")

    async def create_model(self, request: CreateModelRequest, tenant: str) -> dict[str, str]:
        model_id = model_id_for(request.session_id, request.model_seq_id)
        family = optimizer_family(request.optimizer_config)
        # The family goes with the model's config (not for AdamW, the default): a restore rebuilds its spec from it.
        optimizer = {"optimizer": family} if family != "adamw" else {}
        lora_config = {**(request.lora_config or {}), **optimizer}
        spec = LoraSpec.from_config(lora_config)
        base_model, context = split_context_suffix(request.base_model)
        exists = await self._futures.trainer_of.remote(model_id, tenant)
        if not exists:  # the tenant's limits first: a base model it may not train is refused as that
            await self._futures.check_new_model.remote(tenant, base_model, spec.rank)
        if base_model not in self._base_models:
            raise InvalidRequestError(f"base_model {request.base_model!r} is not served here; use one of "
                                      f"{', '.join(self._base_models)}.")
        check_context(base_model, context)
        await self._futures.check_session.remote(request.session_id, tenant)  # model ids are named after their session
        # A full cluster is a 429 the client may retry, with nothing recorded; a retry of a model already created
        # skips placement and finds its first future.
        trainer = None if exists else await self._actors.place(base_model, tenant)
        submission = Submission(model_id, Kind.CREATE_MODEL,
                                {"base_model": base_model, "lora": request.lora_config, **optimizer},
                                seq_id=0, tenant=tenant, trainer=trainer)
        model = NewModel(base_model, lora_config, request.session_id, request.user_metadata)
        return await self._submissions.record_new_model(
            submission, model, lambda actor, request_id: actor.create_model_future.remote(model_id, spec, request_id))

    async def model_info(self, request: ModelRequest, tenant: str) -> dict[str, Any]:
        """The SDK's ``GetInfoResponse`` of one of the caller's loaded models."""
        model = await self._futures.model.remote(request.model_id, tenant)
        if model["unloaded_at"] is not None:
            raise unloaded_error(request.model_id, model["unloaded_reason"])
        base = model["base_model"]
        data = {"arch": base_model_spec(base).arch, "model_name": base, "tokenizer_id": base}
        trained = await self._trained_projections(model)
        if trained is not None:
            data["trained_projections"] = trained
        return {"model_id": request.model_id, "model_data": data,
                "is_lora": True, "lora_rank": model["lora_config"].get("rank"), "model_name": base,
                "type": "get_info"}

    async def _trained_projections(self, model: dict[str, Any]) -> list[str] | None:
        """The projections a model's adapter trains (``LoraBank.projections`` of what its config asks for), as its
        trainer says; None when the trainer does not answer within seconds (it is restarting, or its node left)."""
        trainer = model["trainer"]
        facts = await trainer_facts([trainer], ANSWER_WITHIN_S) if trainer else {}
        if trainer not in facts:
            return None
        projections = facts[trainer]["projections"]
        return sorted(name for target in LoraSpec.from_config(model["lora_config"]).targets()
                      for name in projections[target])

    async def unload_model(self, request: ModelRequest, tenant: str) -> dict[str, str]:
        return await unload_model(self._futures, request.model_id, tenant)

    async def load_weights(self, request: LoadWeightsRequest, tenant: str) -> dict[str, str]:
        if request.loads_into_model == request.creates_model:
            raise InvalidRequestError("load_weights takes either model_id and seq_id (load into that model) or "
                                      "session_id and model_seq_id (create a model from the checkpoint).")
        if request.creates_model:
            return await self._create_model_from_checkpoint(request, tenant)
        return await self._load_into_model(request, tenant)

    async def _create_model_from_checkpoint(self, request: LoadWeightsRequest, tenant: str) -> dict[str, str]:
        """Create-via-load (the SDK's ``create_training_client_from_state[_with_optimizer]``): a new model
        ``{session_id}:train:{model_seq_id}`` on a trainer serving the checkpoint's base model, whose first command
        (seq 0, its creation) loads the checkpoint's adapter, and its optimizer state when ``optimizer`` is true. A
        retry finds the first future instead of a second model. The checkpoint is read by the trainer the new model
        is placed on: on a multi-node cluster, the checkpoint directory must be shared storage."""
        assert request.session_id is not None and request.model_seq_id is not None  # creates_model says so
        model_id = model_id_for(request.session_id, request.model_seq_id)
        path = request.path
        _, kind, _ = parse_tinker_path(path)
        if kind != WEIGHTS:
            raise InvalidRequestError(f"{path!r} is not a training checkpoint; create a training client from a path "
                                      "save_state (save_weights) returned: tinker://<run>/weights/<name>.")
        await self._futures.check_session.remote(request.session_id, tenant)
        base_model = (await self._checkpoint_run(path, tenant))["base_model"]
        if request.base_model not in (None, base_model):
            raise InvalidRequestError(f"{path!r} was trained on {base_model!r}; leave base_model out or pass that "
                                      "one.")
        # Resuming the optimizer state resumes its family: one named here must be that one.
        family = optimizer_family(request.optimizer_config) if request.optimizer_config else None
        load = LoadRequest(path=path, optimizer=request.optimizer)
        trainer, spec = None, LoraSpec()  # both stay unused when the model exists already
        if not await self._futures.trainer_of.remote(model_id):
            # Placed and checked before anything is recorded: a full cluster or a missing checkpoint is a plain 4xx.
            await self._futures.check_new_model.remote(tenant, base_model, 0)  # its rank: checked once read
            trainer = await self._actors.place(base_model, tenant)
            spec = await self._actors.trainer(trainer).weights_spec.remote(path)
            if not request.optimizer:  # a new run from the weights: with the optimizer asked for, AdamW by default
                spec = dataclasses.replace(spec, optimizer=family or "adamw")
            elif family not in (None, spec.optimizer):
                raise InvalidRequestError(f"{path!r} was trained with {spec.optimizer}, not {family}; leave "
                                          "optimizer_config out to resume its optimizer state, or pass that one.")
            await self._futures.check_new_model.remote(tenant, base_model, spec.rank)
        submission = Submission(model_id, Kind.LOAD_WEIGHTS, {"path": path, "optimizer": load.optimizer,
                                                              "base_model": base_model},
                                seq_id=0, tenant=tenant, trainer=trainer).prepared()
        model = NewModel(base_model, dataclasses.asdict(spec), request.session_id, request.user_metadata)

        async def start(actor: ActorHandle, request_id: str) -> None:
            await actor.create_model_from_checkpoint.remote(model_id, spec, Command(
                model_id, 0, Kind.LOAD_WEIGHTS, request_id, payload=load, fingerprint=submission.payload_sha256))

        return await self._submissions.record_new_model(submission, model, start)

    async def _load_into_model(self, request: LoadWeightsRequest, tenant: str) -> dict[str, str]:
        """load_weights into an existing model, in its seq order (the legacy form, with model_id and seq_id), from a
        checkpoint of one of the caller's runs."""
        assert request.model_id is not None and request.seq_id is not None  # loads_into_model says so
        load = LoadRequest(path=request.path, optimizer=request.optimizer)
        async with self._submissions.spending_seq(request.model_id, request.seq_id, tenant):
            await self._checkpoint_run(load.path, tenant)
        return await self._submissions.submit(
            Command(request.model_id, request.seq_id, Kind.LOAD_WEIGHTS, "", payload=load),
            {"path": load.path, "optimizer": load.optimizer}, tenant)

    async def _check_storage(self, tenant: str) -> None:
        """Raises QuotaExceededError when ``tenant``'s checkpoints already take its ``storage_gb`` (the tenants file),
        measured now (checkpoints only: page files are lilo's own, and go when their model does)."""
        limit_gb = (await self._futures.limits_of.remote(tenant)).storage_gb
        if limit_gb is None:
            return
        used = await self._storage_bytes(tenant)
        if used >= limit_gb * 1e9:
            raise QuotaExceededError(
                f"Tenant {tenant!r} may keep {limit_gb:g} GB of checkpoints (storage_gb in the tenants file) and "
                f"keeps {used / 1e9:.3g} GB; delete some (tinker checkpoint delete) or let their TTL expire, then save "
                "again.")

    async def _checkpoint_run(self, path: str, tenant: str) -> dict[str, Any]:
        run, _, _ = parse_tinker_path(path)
        return await self._actors.readable_run(path, tenant, f"No training run {run!r} here, so no checkpoint "
                                                             f"{path!r}; pass a path save_state returned.")

    async def forward_backward(self, call: ForwardBackwardCall, tenant: str) -> dict[str, str]:
        train = call.train
        # Stored (fingerprinted) as the client sent it: a retry is compared with what it sent, not with the records.
        stored = {"loss_fn": train.loss_fn, "loss_config": dict(train.loss_config),
                  "data": [{"tokens": d.tokens, "inputs": dict(d.loss_inputs),
                            "provenance": d.provenance and dataclasses.asdict(d.provenance),
                            **({"images": image_fingerprints(d.images)} if d.images else {})} for d in train.data]}
        async with self._submissions.spending_seq(call.model_id, call.seq_id, tenant):
            if has_images(train):
                model = await self._futures.model.remote(call.model_id, tenant)
                train = await with_images_laid_out(train, model["base_model"])
            train = await self.custom_losses.resolved(train, tenant)
            check_train_input(train)
            if train.loss_fn in NEEDS_PROVENANCE:
                records = await self._futures.recorded_sequences.remote(
                    call.model_id, named_sequences(d.provenance for d in train.data), tenant)
                train = with_recorded_inputs(train, records)
        kind = Kind.FORWARD if call.forward_only else Kind.FORWARD_BACKWARD
        # No batch key: every loss shares a pass (each datum takes its own loss and config in it).
        return await self._submissions.submit(
            Command(call.model_id, call.seq_id, kind, "", payload=train, tokens=train.tokens), stored, tenant)

    async def optim_step(self, request: OptimStepRequest, tenant: str) -> dict[str, str]:
        async with self._submissions.spending_seq(request.model_id, request.seq_id, tenant):
            params = step_params(request.adam_params, request.optimizer_params)
        return await self._submissions.submit(
            Command(request.model_id, request.seq_id, Kind.OPTIM_STEP, "", payload=params),
            request.optimizer_params or request.adam_params, tenant)

    async def save(self, request: SaveWeightsRequest, kind: Kind, tenant: str) -> dict[str, str]:
        """A named save (``save_weights``, ``save_weights_for_sampler`` or ``save_weights_external``); its
        ``ttl_seconds`` (none: never) is recorded as the checkpoint's expiry once the save is accepted."""
        name = request.path
        async with self._submissions.spending_seq(request.model_id, request.seq_id, tenant):
            if not name:
                raise InvalidRequestError(f"{kind} needs a path (the checkpoint's name).")
            # Refused now: no name that could escape the checkpoint directory reaches a trainer.
            checked_client_name(name, kind)
            await self._check_storage(tenant)
            expires_at = expiry_for(request.ttl_seconds, time.time())
            if request.age_encryption_recipients:
                raise InvalidRequestError("lilo does not encrypt exported weights (its links are signed and expire); "
                                          "leave age_encryption_recipients out.")
        submitted = await self._submissions.submit(
            Command(request.model_id, request.seq_id, kind, "", payload=SaveRequest(name)), {"path": name}, tenant)
        await self._futures.record_checkpoint_save.remote(tinker_path(request.model_id, kind, name), tenant,
                                                          expires_at)
        return submitted
