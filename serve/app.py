"""The FastAPI ingress, deployed on Ray Serve, that speaks the Tinker HTTP API under /api/v1.

(No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime, and through
Serve's ingress wrapper string annotations of body models do not resolve.)
"""

from typing import Any

import ray
from fastapi import FastAPI, HTTPException, Query, Response
from pydantic import BaseModel, Field
from ray import serve
from ray.exceptions import RayActorError

from cluster.futures_actor import FUTURES_ACTOR_NAME, RETRIEVE_TIMEOUT_S
from cluster.local import NAMESPACE
from cluster.timing import get_timing_actor

from lilo import __version__
from lilo.backend.registry import base_model_spec
from lilo.settings import Settings
from serve.errors import install_error_handlers

APP_NAME = "lilo"
INGRESS_NAME = "LiloIngress"
MAX_ID_CHARS = 256

api = FastAPI(title="lilo", version=__version__, summary="Tinker-compatible multi-LoRA training service")
install_error_handlers(api)


class RetrieveFutureRequest(BaseModel):
    request_id: str = Field(max_length=MAX_ID_CHARS)
    allow_metadata_only: bool = False


@serve.deployment(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class LiloIngress:
    """Stateless HTTP front: several replicas may run; everything stateful lives in actors behind it."""

    def __init__(self, base_models: list[str]) -> None:
        self._timing = get_timing_actor()
        self._futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
        self._capabilities = {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": base_model_spec(name).max_context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for name in base_models
            ]
        }

    @api.get("/api/v1/healthz")
    def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    # The first call the tinker SDK makes; {} means "use the SDK's defaults" for every feature flag.
    @api.post("/api/v1/client/config")
    def client_config(self) -> dict[str, Any]:
        return {}

    @api.get("/api/v1/get_server_capabilities")
    def get_server_capabilities(self) -> dict[str, Any]:
        return self._capabilities

    @api.post("/api/v1/retrieve_future", response_model=None)
    async def retrieve_future(self, body: RetrieveFutureRequest) -> Response | dict[str, Any]:
        """Long-poll one future: its result once finished, else ``try_again`` (the SDK re-polls at once)."""
        state = await self._futures.retrieve.remote(body.request_id, RETRIEVE_TIMEOUT_S)
        if state.status == "pending":
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if state.status == "failed":
            return {"error": state.error, "category": state.category or "server"}
        return Response(content=state.result, media_type="application/json")

    @api.get("/api/v1/timing")
    async def timing(
        self,
        model_id: str | None = Query(None, max_length=MAX_ID_CHARS, description="a model id; none: the cluster"),
        reset: bool = Query(False, description="start this reader's next interval now"),
        reader: str = Query("", max_length=MAX_ID_CHARS, description="whose interval reset refers to"),
    ) -> dict[str, Any]:
        """Critical path of one model (queue wait vs execute vs capture/persist, batch sharing), or the cluster's."""
        snapshot = await self._ask_timing_actor(model_id, reset, reader)
        if snapshot is None:
            raise HTTPException(
                status_code=404,
                detail=f"Unknown model_id {model_id!r}: no trainer has reported timing for it. "
                "Pass the model_id that create_model returned, or leave model_id out for the cluster-wide view.",
            )
        return snapshot

    async def _ask_timing_actor(self, model_id: str | None, reset: bool, reader: str) -> dict[str, Any] | None:
        """A placed model's timing comes fresh from the trainer that owns it; everything else (the cluster view, a
        model no trainer holds any more) from the timing actor's merged view."""
        if model_id is not None:
            trainer = (await self._futures.placement.remote()).get(model_id)
            if trainer is not None:
                snapshot = await ray.get_actor(trainer, namespace=NAMESPACE).timing.remote(model_id, reset, reader)
                if snapshot is not None:
                    return snapshot
        try:
            return await self._timing.snapshot.remote(model_id, reset, reader)
        except RayActorError:
            # The detached actor was restarted or re-created: look it up again by name, once.
            self._timing = get_timing_actor()
            return await self._timing.snapshot.remote(model_id, reset, reader)


def build_application(settings: Settings) -> serve.Application:
    """The Serve application for these settings."""
    return LiloIngress.bind(list(settings.base_models))
