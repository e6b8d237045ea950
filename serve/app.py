"""The FastAPI ingress, deployed on Ray Serve, that speaks the Tinker HTTP API under /api/v1."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve

from lilo import __version__
from lilo.backend.registry import base_model_spec
from lilo.settings import Settings

APP_NAME = "lilo"
INGRESS_NAME = "LiloIngress"

api = FastAPI(title="lilo", version=__version__, summary="Tinker-compatible multi-LoRA training service")


@serve.deployment(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class LiloIngress:
    """Stateless HTTP front: several replicas may run; everything stateful lives in actors behind it."""

    def __init__(self, base_models: list[str]) -> None:
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


def build_application(settings: Settings) -> serve.Application:
    """The Serve application for these settings."""
    return LiloIngress.bind(list(settings.base_models))
