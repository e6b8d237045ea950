"""The sampling half of the Tinker API: sampling sessions, ephemeral sampler weights, and ``asample``.

How a sample finds its weights, kept simple:
- A sampling session samples either a sampler checkpoint (``model_path``, a PEFT adapter that
  ``save_weights_for_sampler`` wrote) or the bare base model. Sessions are rows in the futures DB; an
  ephemeral sampler save (``save_weights_and_get_sampling_client``) is a sampler checkpoint with a generated name
  (``ephemeral-<seq_id>``, a prefix no client may name a sampler checkpoint with) whose session is recorded before
  the save runs.
- Each session samples on one trainer (``cluster.placement.choose_sampling_trainer``): for a checkpoint, the
  trainer of the training run that wrote it, else one serving the session's base model.
- The trainer loads a checkpoint into a free adapter slot on first use and keeps it there while slots allow (the
  least recently used one gives its slot up to whoever needs it, a new training model included); the bare base
  model runs through no adapter. Samples of many sessions and checkpoints share one generation.
- Samples skip the models' seq order; the engine gives them one turn in its rotation, each turn one generation
  within the token budget, so training of other models waits for at most one batch of samples.
- Retries are deduplicated on ``(sampling_session_id, seq_id)`` like training steps; ``sample_sequence_ids`` are
  ``<request_id>:<k>``, the same for a retry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ray.exceptions import RayActorError

from cluster.futures_actor import SESSION_POLL_TIMEOUT_S
from cluster.placement import choose_sampling_trainer, trainer_facts as ask_trainer_facts
from lilo.backend.checkpoints.paths import INFLIGHT_NAME, ephemeral_name, sampler_run, tinker_path
from lilo.backend.registry import base_model_spec
from lilo.backend.types import SaveRequest
from lilo.engine.commands import Command, Kind
from lilo.errors import InvalidRequestError
from lilo.image_assets import NO_ASSETS, ImageAssets
from lilo.futures.store import Submission, parse_request_id, unknown_sampling_session_error
from lilo.protocol.sampling import decode_sample_request, has_images as has_image_chunks
from lilo.tenants import may_see
from serve.tinker.actors import Actors
from serve.tinker.images import image_fingerprints, layout_of
from serve.tinker.requests import (
    CreateSamplingSessionRequest, RetrieveFuturesRequest, SampleRequest, SamplingSessionRequest, SaveWeightsRequest,
)
from serve.tinker.submissions import Submissions

# Routes of this many sessions are remembered per ingress replica (they never change; past it, all are dropped).
MAX_ROUTES = 100_000


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    # The client counts sampling sessions per session, so the id is a function of what it sends: a retried
    # create_sampling_session (or ephemeral save) names the same session.
    return f"{session_id}:sample:{sampling_session_seq_id}"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a session's samples run, and what they are checked against."""

    trainer: str
    tenant: str | None  # whose session it is
    model_path: str | None  # the sampler checkpoint; None: the bare base model
    base_model: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: Sequence[int]


class SamplingRouter:
    """Routes sampling sessions to trainers. Trainer facts are asked once; a session's route is kept."""

    def __init__(self, actors: Actors) -> None:
        self._actors = actors
        self._futures = actors.futures
        self._facts: dict[str, dict[str, Any]] | None = None
        self._routes: dict[str, Route] = {}

    async def trainer_facts(self) -> dict[str, dict[str, Any]]:
        """Per trainer: what ``TrainerActor.ready`` says (its base model, vocabulary size, end-of-sequence ids);
        asked again when the registry's trainers change."""
        names = tuple(await self._actors.trainers())
        if self._facts is None or tuple(self._facts) != names:
            self._facts = await ask_trainer_facts(names)
        return self._facts

    async def trainer_for(self, sampling_session_id: str, base_model: str, checkpoint_trainer: str | None) -> str:
        facts = await self.trainer_facts()
        served = {name: fact["base_model"] for name, fact in facts.items()}
        return choose_sampling_trainer(sampling_session_id, base_model, served, checkpoint_trainer)

    async def route(self, sampling_session_id: str, tenant: str) -> Route:
        """The session's route; 404 unless it is one of ``tenant``'s (checked before its requests are, so another
        tenant's session is refused like an unknown one whatever the request)."""
        route = self._routes.get(sampling_session_id)
        if route is not None and route.trainer not in await self._actors.trainers():
            route = None  # its trainer left the service (its node left, or it was let go): route it again
        if route is None:
            session = await self._futures.sampling_session.remote(sampling_session_id, tenant)
            model_path = session["model_path"]
            checkpoint_trainer = await self._futures.trainer_of.remote(sampler_run(model_path)) if model_path else None
            trainer = await self.trainer_for(sampling_session_id, session["base_model"], checkpoint_trainer)
            fact = (await self.trainer_facts())[trainer]
            route = Route(trainer, session["tenant"], model_path, session["base_model"], fact["vocab_size"],
                          base_model_spec(session["base_model"]).max_context_length, fact["eos_token_ids"])
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            self._routes[sampling_session_id] = route
        if not may_see(tenant, route.tenant):
            raise unknown_sampling_session_error(sampling_session_id)
        return route


class Sampling:
    """Sampling sessions of the caller's tenant, their samples, and the sampler saves that open one."""

    def __init__(self, actors: Actors, submissions: Submissions, assets: ImageAssets = NO_ASSETS) -> None:
        self._actors = actors
        self._futures = actors.futures
        self._submissions = submissions
        self._router = SamplingRouter(actors)
        self._assets = assets  # what image_asset_pointer chunks may point at

    async def create_session(self, request: CreateSamplingSessionRequest, tenant: str) -> dict[str, str]:
        """A session sampling ``model_path`` (a sampler checkpoint of the caller's, or a published one) or, without
        one, the bare ``base_model``."""
        sampling_session_id = sampling_session_id_for(request.session_id, request.sampling_session_seq_id)
        model_path, base_model = request.model_path, request.base_model
        await self._futures.check_session.remote(request.session_id, tenant)
        if model_path:
            run = await self._training_run(model_path, tenant)
            if base_model and base_model != run["base_model"]:
                raise InvalidRequestError(f"{model_path!r} was trained on {run['base_model']!r}, not {base_model!r}; "
                                          "leave base_model out or pass that one.")
            base_model = run["base_model"]
            trainer = await self._router.trainer_for(sampling_session_id, base_model, run["trainer"])
            await self._actors.trainer(trainer).check_sampler_checkpoint.remote(model_path)
        elif base_model:
            # Refuses a base model no trainer serves.
            await self._router.trainer_for(sampling_session_id, base_model, None)
        else:
            raise InvalidRequestError("create_sampling_session needs a model_path (a sampler checkpoint) or a "
                                      "base_model.")
        await self._futures.add_sampling_session.remote(sampling_session_id, request.session_id, base_model,
                                                        model_path, tenant)
        return {"sampling_session_id": sampling_session_id, "type": "create_sampling_session"}

    async def _training_run(self, model_path: str, tenant: str) -> dict[str, Any]:
        run = sampler_run(model_path)
        return await self._actors.readable_run(model_path, tenant, f"No training run {run!r} saved {model_path!r}; "
                                                                   "pass a path save_weights_for_sampler returned.")

    async def retrieve_futures(self, request: RetrieveFuturesRequest, tenant: str) -> dict[str, Any]:
        """One poll of a sampling client's requests: those finished after its cursor (the SDK's FutureCompletion
        list) and the next cursor. Long-polls unless ``timeout`` is 0; one ledger statement answers every poll
        parked together (lilo.futures.session_waiter)."""
        target = request.target
        await self._router.route(target.sampling_session_id, tenant)  # 404 unless it is the caller's
        timeout_s = SESSION_POLL_TIMEOUT_S if request.timeout is None else request.timeout
        try:
            finished, cursor = await self._futures.retrieve_session.remote(
                target.sampling_session_id, target.cloned_sampler_id, request.prev_cursor, timeout_s)
        except RayActorError:
            # The futures DB is restarting (its file keeps every result): nothing new yet; the client polls again.
            finished, cursor = [], request.prev_cursor
        return {"completions": [request.as_wire() for request in finished], "cursor": cursor}

    async def cancel(self, request_id: str, tenant: str) -> None:
        """Cancel a sample its client abandoned (the SDK's cancel_future): out of its trainer's queue, or stopped at
        its next token; it fails with a message, which the ledger records. A finished one is left as it is."""
        trainer = await self._futures.sample_to_cancel.remote(request_id, tenant)
        if trainer is not None:
            try:
                await self._actors.trainer(trainer).cancel_sample.remote(str(parse_request_id(request_id)))
            except RayActorError:
                pass  # its trainer is gone, and with it the sample: the recovery fails its future

    async def join(self, request: SamplingSessionRequest, tenant: str) -> dict[str, Any]:
        """A clone id for an unpickled SamplingClient, unique among the session's clients (the original is 0)."""
        counter = await self._futures.join_sampling_session.remote(request.sampling_session_id, tenant)
        return {"type": "join_sampling_session", "client_counter": counter}

    async def sampler(self, sampling_session_id: str, tenant: str) -> dict[str, Any]:
        """The SDK's ``GetSamplerResponse``."""
        session = await self._futures.sampling_session.remote(sampling_session_id, tenant)
        return {"sampler_id": sampling_session_id, "base_model": session["base_model"],
                "model_path": session["model_path"]}

    async def save_opening_session(self, request: SaveWeightsRequest, tenant: str) -> dict[str, str]:
        """``save_weights_for_sampler`` without a name: a sampler checkpoint whose future answers with the sampling
        session that samples it. A snapshot gets a checkpoint of its own; an ``inflight`` save writes the model's
        one inflight checkpoint again (``INFLIGHT_NAME``), so every inflight session of the model, old and new,
        samples the new weights (a torch generation under way from its next token); each save opens a new session.

        Both are named after the request's ``seq_id``, not its ``sampling_session_seq_id``: the SDK counts the
        latter up on every attempt, so a retry of a request already recorded would otherwise differ from it, a 409
        that the SDK retries (counting up again) until it gives up."""
        model_id, seq = request.model_id, request.seq_id
        model = await self._futures.model.remote(model_id, tenant)
        name = INFLIGHT_NAME if request.kind == "inflight" else ephemeral_name(seq)
        sampling_session_id = sampling_session_id_for(model_id, seq)
        await self._futures.add_sampling_session.remote(
            sampling_session_id, model["session_id"] or "", model["base_model"],
            tinker_path(model_id, Kind.SAVE_WEIGHTS_FOR_SAMPLER, name), tenant)
        return await self._submissions.submit(
            Command(model_id, seq, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "", payload=SaveRequest(name, sampling_session_id)),
            {"path": name, "sampling_session_id": sampling_session_id}, tenant)

    async def sample(self, request: SampleRequest, tenant: str) -> dict[str, Any]:
        sampling_session_id = request.sampling_session_id
        if not sampling_session_id:
            raise InvalidRequestError("asample needs the sampling_session_id that create_sampling_session returned.")
        route = await self._router.route(sampling_session_id, tenant)
        # Decoded from the SDK's JSON as sent: the scoring fields newer SDKs add (topk_prompt_logprobs, ...) are
        # extras of SampleRequest, which lilo.protocol.sampling reads with the rest.
        body = request.model_dump()
        images = await layout_of(route.base_model) if has_image_chunks(body.get("prompt") or {}) else None
        sample = decode_sample_request(body, vocab_size=route.vocab_size, max_context_length=route.max_context_length,
                                       eos_token_ids=route.eos_token_ids, base_only=route.model_path is None,
                                       images=images, assets=self._assets)
        # The backend samples through the checkpoint named by the command's model id (a base-model sample through
        # none; its id then only labels its timing).
        command = Command(route.model_path or sampling_session_id, request.seq_id, Kind.SAMPLE, "", payload=sample,
                          tokens=sample.num_samples * (len(sample.prompt) + sample.max_tokens))
        request_id = await self._submissions.submit_to(
            Submission(sampling_session_id, Kind.SAMPLE,
                       {**dataclasses.asdict(sample), "images": image_fingerprints(sample.images)},
                       seq_id=request.seq_id,
                       tenant=tenant, trainer=route.trainer), command)
        return {"request_id": str(request_id), "type": Kind.SAMPLE,
                "sample_sequence_ids": [f"{request_id}:{k}" for k in range(sample.num_samples)]}
