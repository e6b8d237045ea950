"""The control plane behind the HTTP routes: one object per ingress replica, holding the futures DB actor's handle,
the trainer registry's cached view and the sampling router, whose parts take each route's typed request and the
caller's tenant.

- ``training``: sessions, models, training steps and named saves (serve.tinker.training)
- ``sampling``: sampling sessions and samples (serve.tinker.sampling)
- ``runs`` and ``checkpoints``: training runs and checkpoints as the RestClient reads and changes them
- ``sessions`` and ``heartbeats``: sessions as the RestClient reads them, and their heartbeats
- ``timing``: the critical path of a model or of the cluster
- ``console``: what the console page shows (serve.console)
- ``openai``: the OpenAI-compatible endpoint (serve.openai.endpoint)
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Sequence

from fastapi import Response
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from cluster.futures_actor import RETRIEVE_TIMEOUT_S
from cluster.reconciler import TrainerDirectory
from lilo.image_assets import NO_ASSETS, ImageAssets
from lilo.storage import Storage
from lilo.backend.registry import base_model_spec
from lilo.engine.commands import Kind
from lilo.futures.billing import check_window
from lilo.futures.schema import PENDING
from lilo.futures.store import FutureState, parse_request_id
from serve.console.overview import ConsoleOverview
from serve.openai.endpoint import OpenAICompatible
from serve.tinker.actors import Actors
from serve.tinker.checkpoints import Checkpoints
from serve.tinker.heartbeats import SessionBeats
from serve.tinker.requests import PROTOBUF, RetrieveFutureRequest, SaveWeightsRequest
from serve.tinker.runs import Runs
from serve.tinker.sampling import Sampling
from serve.tinker.session_traces import SessionTraces
from serve.tinker.sessions import Sessions
from serve.tinker.pushed_results import PushedResults
from serve.tinker.submissions import Submissions
from serve.tinker.timing import Timing
from serve.tinker.training import Training

# Results the SDK accepts only as protobuf.
PROTOBUF_RESULTS = {Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.SAMPLE}


def server_capabilities(base_models: Sequence[str]) -> dict[str, Any]:
    """The SDK's ``GetServerCapabilitiesResponse``: every base model is trainable and sampleable here."""
    return {"supported_models": [{"model_name": name, "max_context_length": base_model_spec(name).max_context_length,
                                  "trainable": True, "sampleable": True} for name in base_models]}


def future_response(request_id: str, state: FutureState) -> Response | dict[str, Any]:
    """What retrieve_future answers for a future in ``state``: ``try_again`` (the SDK re-polls at once) while it is
    pending, its error once failed, else its result in the format the SDK reads it in."""
    if state.status == "pending":
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    if state.status == "failed":
        return {"error": state.error, "category": state.category or "server"}
    media_type = PROTOBUF if state.kind in PROTOBUF_RESULTS else "application/json"
    return Response(content=state.result, media_type=media_type)


class ControlPlane:
    def __init__(self, futures: ActorHandle, base_models: Sequence[str], url_secret: bytes,
                 trainer_wait_s: float = 0.0, image_assets: ImageAssets = NO_ASSETS,
                 storage: Storage | None = None) -> None:
        actors = Actors(futures, TrainerDirectory(), trainer_wait_s)
        self._pushed = PushedResults(futures)
        submissions = Submissions(futures, self._pushed)
        self._futures = futures
        self.capabilities = server_capabilities(base_models)
        self.runs = Runs(actors)
        self.training = Training(actors, submissions, base_models, self.runs.storage_bytes)
        self.sampling = Sampling(actors, submissions, image_assets)
        self.checkpoints = Checkpoints(actors, url_secret, storage)
        self.sessions = Sessions(actors, self.runs)
        self.heartbeats = SessionBeats(futures)
        self.timing = Timing(actors)
        self.session_traces = SessionTraces(actors, self.timing, url_secret)
        self.console = ConsoleOverview(actors, self.runs)
        self.openai = OpenAICompatible(actors, base_models, image_assets)

    async def save_weights_for_sampler(self, request: SaveWeightsRequest, tenant: str) -> dict[str, str]:
        """A named sampler checkpoint, or without a name one that opens a sampling session (the SDK's
        save_weights_and_get_sampling_client)."""
        if request.opens_sampling_session:
            return await self.sampling.save_opening_session(request, tenant)
        return await self.training.save(request, Kind.SAVE_WEIGHTS_FOR_SAMPLER, tenant)

    async def billing_usage(self, starting_on: datetime.datetime, ending_before: datetime.datetime,
                            tenant: str) -> dict[str, Any]:
        """``tinker billing usage``: the caller's usage in hourly buckets (lilo.futures.billing)."""
        start, end = check_window(starting_on, ending_before, time.time())
        return await self._futures.billing_usage.remote(tenant, start, end)

    async def retrieve_future(self, request: RetrieveFutureRequest, tenant: str) -> Response | dict[str, Any]:
        """Long-poll one future: its result once finished, else ``try_again``. One this replica submitted waits for
        its result to be pushed here; any other asks the futures DB."""
        request_id = parse_request_id(request.request_id)
        try:
            try:
                state = await self._pushed.wait(request_id, RETRIEVE_TIMEOUT_S, tenant)
            except TimeoutError:  # the long-poll ran here: the futures DB says where it stands now
                state = await self._futures.retrieve.remote(request_id, 0, tenant)
            if state is None:
                state = await self._futures.retrieve.remote(request_id, RETRIEVE_TIMEOUT_S, tenant)
        except RayActorError:
            # The futures DB is restarting (its file keeps every result): the client polls again, as for pending.
            state = FutureState(0, PENDING)
        return future_response(request.request_id, state)
