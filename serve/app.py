"""The FastAPI ingress, deployed on Ray Serve, that speaks the Tinker HTTP API under /api/v1. Each route is one call
to the replica's control plane (serve.control), with the typed request FastAPI validated (serve.tinker.requests).

(No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime, and through
Serve's ingress wrapper string annotations of body models do not resolve.)
"""

import datetime
import sys
from pathlib import Path
from typing import Any, Sequence

import ray
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from ray import serve

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.worker_setup import freeze_startup

from lilo import __version__
from lilo.image_assets import ImageAssets
from lilo.storage import CHECKPOINTS, Storage
from lilo.api_keys import HEADER, ApiKeys
from lilo.settings import Settings
from lilo.engine.commands import Kind
from lilo.errors import NotFoundError
from lilo.session_tokens import SessionTokens
from lilo.signed_urls import read_secret, secret_file
from lilo.timing.traces import traces_endpoint
from serve.console.routes import router as console_router
from serve.control import ControlPlane
from serve.http.auth import ApiKeyGate, caller
from serve.http.direct_ingress import reuse_listening_address
from serve.http.errors import ERROR_RESPONSES, install_error_handlers
from serve.http.json_body import INT64_MAX, StrictJsonRoute
from serve.http.limits import BodyLimit, JsonOnly
from serve.http.request_traces import TraceRequests
from serve.openai.endpoint import openai_route
from serve.openai.keys import OPENAI_ROUTES
from serve.openai.params import ChatCompletionBody, CompletionBody
from serve.tinker.auth import exchanged, key_details, refuse_deletion
from serve.tinker.client_flags import client_config, dynamic_config
from serve.tinker.keys import TINKER_ROUTES
from serve.tinker.session_traces import TRACE_ROUTE
from serve.tinker.requests import (
    MAX_ID_CHARS, Body, CopyWeightsRequest, CreateCustomLossRequest, CreateModelRequest, CreateSamplingSessionRequest,
    FinishSessionRequest, LoadWeightsRequest, ModelRequest, OptimStepRequest, RetrieveFutureRequest,
    RetrieveFuturesRequest, SampleRequest, SamplingSessionRequest, SaveWeightsRequest, SessionRequest,
    SessionSearchRequest, TinkerPathRequest, TtlRequest, read_forward_backward,
)

APP_NAME = "lilo"
INGRESS_NAME = "LiloIngress"
MAX_PAGE = 1000  # training runs or checkpoints per listing page
# Requests one ingress replica holds at once. Serve's default (5) suits a replica that computes; this one only
# awaits actors, and every client keeps a retrieve_future long-poll open, so a small cap would queue clients'
# submissions behind other clients' polls in the proxy.
MAX_ONGOING_REQUESTS = 8192
NO_PROJECTS = ("lilo keeps no projects: each API key's tenant is one space of its own. A project id a client sends "
               "is recorded with its session (search_sessions finds it) but changes nothing.")

api = FastAPI(title="lilo", version=__version__, summary="Tinker-compatible multi-LoRA training service",
              responses=ERROR_RESPONSES)
api.router.route_class = StrictJsonRoute  # before the routes below are made
install_error_handlers(api)
api.add_middleware(JsonOnly, protobuf_paths=frozenset({"/api/v1/forward_backward"}))
api.add_middleware(BodyLimit)
# Each middleware added runs before those added earlier: the key gate before the limits (nothing of an
# unauthenticated request is read), the request's span around everything (a refused request is traced too).
api.add_middleware(ApiKeyGate, routes=(TINKER_ROUTES, OPENAI_ROUTES))
if traces_endpoint() is not None:
    api.add_middleware(TraceRequests)
api.include_router(console_router)  # the console's page and files (serve/console; docs/console.md)


# On the head node (Ray gives it this resource), beside the futures DB actor it calls on every request: a worker node
# that leaves never takes the ingress along, which would leave clients without one until Serve placed another.
HEAD_NODE = {"node:__internal_head__": 0.001}
GIL_SWITCH_INTERVAL_S = 0.001


# No access log: a line written per request (two per operation) on the path of every one; lilo's request traces
# (docs/timing.md) say more, when an endpoint is set.
@serve.deployment(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
                  max_ongoing_requests=MAX_ONGOING_REQUESTS, logging_config={"enable_access_log": False})
@serve.ingress(api)
class LiloIngress:
    """Stateless HTTP front: several replicas may run; everything stateful lives in actors behind it."""

    def __init__(self, base_models: list[str], trainer_wait_s: float, max_body_bytes: int,
                 api_key_digests: dict[str, str], url_secret_file: str, compress_bodies: str = "auto",
                 image_dirs: Sequence[str] = (), storage: str | None = None) -> None:
        reuse_listening_address()  # before Serve binds lilo's port in this replica
        # Serve's HTTP loop, the loop running these routes and Ray's threads hand each request to one another; a
        # waiting thread gets the GIL within 1 ms instead of CPython's 5 (bench_load's heartbeat p99: 47-49 ms
        # against 50-52 ms).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        BodyLimit.limit_bytes = max_body_bytes
        self._compress_bodies = compress_bodies
        ApiKeyGate.keys = ApiKeys(api_key_digests)
        ApiKeyGate.tokens = self._tokens = SessionTokens(read_secret(Path(url_secret_file)))
        # The trainers come from the reconciler's registry (cluster.reconciler), not from these arguments: they
        # follow the cluster's GPU nodes as they come and go.
        self._control = ControlPlane(ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE), base_models,
                                     read_secret(Path(url_secret_file)), trainer_wait_s, ImageAssets(image_dirs),
                                     Storage(storage).child(CHECKPOINTS) if storage else None)
        freeze_startup()

    # --- the hot routes first: Starlette matches a request against the routes in order, and Serve walks them
    # once more for its metrics, so a route 50 deep cost every retrieve_future about 100 routes tried -------------
    @api.post("/api/v1/retrieve_future", response_model=None)
    async def retrieve_future(self, body: RetrieveFutureRequest,
                              tenant: str = Depends(caller)) -> Response | dict[str, Any]:
        """Long-poll one future: its result once finished, else ``try_again`` (the SDK re-polls at once)."""
        return await self._control.retrieve_future(body, tenant)

    @api.post("/api/v1/forward_backward")
    async def forward_backward(self, request: Request, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.forward_backward(await read_forward_backward(request), tenant)

    @api.post("/api/v1/optim_step")
    async def optim_step(self, body: OptimStepRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.optim_step(body, tenant)

    @api.post("/api/v1/asample")
    async def asample(self, body: SampleRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sampling.sample(body, tenant)

    @api.post("/api/v1/retrieve_futures")
    async def retrieve_futures(self, body: RetrieveFuturesRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sampling.retrieve_futures(body, tenant)

    @api.post("/api/v1/session_heartbeat")
    async def session_heartbeat(self, body: SessionRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        await self._control.heartbeats.beat(body.session_id, tenant)
        return {"type": "session_heartbeat"}

    @api.get("/api/v1/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    # The first call the tinker SDK makes: the feature flags lilo turns on (serve.tinker.client_flags).
    @api.post("/api/v1/client/config")
    async def client_config(self, request: Request) -> dict[str, Any]:
        return client_config(request.client.host if request.client else None, self._compress_bodies)

    @api.get("/api/v1/get_server_capabilities")
    async def get_server_capabilities(self) -> dict[str, Any]:
        return self._control.capabilities

    @api.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(self) -> dict[str, Any]:
        return dynamic_config()

    # --- auth: a key exchanged for a token, a key's metadata (serve.tinker.auth) -------------------------------
    @api.post("/api/v1/auth/token")
    async def auth_token(self, tenant: str = Depends(caller)) -> dict[str, str]:
        return exchanged(self._tokens, tenant)

    @api.get("/api/v1/auth/apikey/me")
    async def api_key_me(self, request: Request, tenant: str = Depends(caller)) -> dict[str, Any]:
        return key_details(request.headers.get(HEADER, ""), tenant)

    @api.delete("/api/v1/auth/apikey/me")
    async def delete_api_key_me(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        refuse_deletion()
        return {}

    @api.post("/api/v1/create_session")
    async def create_session(self, body: Body, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.training.create_session(body, tenant)

    @api.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(self, session_id: str, body: FinishSessionRequest | None = None,
                             tenant: str = Depends(caller)) -> dict[str, Any]:
        await self._control.training.finish_session(session_id, body, tenant)
        return {}

    @api.post("/api/v1/telemetry")
    async def telemetry(self) -> dict[str, str]:
        return {"status": "accepted"}

    @api.post("/api/v1/create_model")
    async def create_model(self, body: CreateModelRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.create_model(body, tenant)

    @api.post("/api/v1/get_info")
    async def get_info(self, body: ModelRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.training.model_info(body, tenant)

    @api.post("/api/v1/save_weights")
    async def save_weights(self, body: SaveWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.save(body, Kind.SAVE_WEIGHTS, tenant)

    @api.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(self, body: SaveWeightsRequest,
                                       tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.save_weights_for_sampler(body, tenant)

    @api.post("/api/v1/save_weights_external")
    async def save_weights_external(self, body: SaveWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        """The adapter as a PEFT directory (adapter_config.json, adapter_model.safetensors) to download through
        get_external_weights_urls' signed links."""
        return await self._control.training.save(body, Kind.SAVE_WEIGHTS_EXTERNAL, tenant)

    @api.post("/api/v1/create_sampling_session")
    async def create_sampling_session(self, body: CreateSamplingSessionRequest,
                                      tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.sampling.create_session(body, tenant)

    @api.get("/api/v1/samplers/{sampling_session_id}")
    async def get_sampler(self, sampling_session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sampling.sampler(sampling_session_id, tenant)

    @api.post("/api/v1/load_weights")
    async def load_weights(self, body: LoadWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.load_weights(body, tenant)

    # --- training runs, checkpoints and unloading (RestClient / CLI; serve/tinker/runs.py, checkpoints.py) ---------
    @api.get("/api/v1/training_runs")
    async def list_training_runs(self, limit: int = Query(20, ge=1, le=MAX_PAGE),
                                 # SQLite's OFFSET takes 64-bit integers (JSON bodies: serve/http/json_body.py)
                                 offset: int = Query(0, ge=0, le=INT64_MAX),
                                 tenant: str = Depends(caller)) -> dict[str, Any]:
        # access_scope and project_id (also sent) change nothing here: a tenant sees its own runs, in one project.
        return await self._control.runs.training_runs(limit, offset, tenant)

    @api.get("/api/v1/training_runs/{training_run_id}")
    async def get_training_run(self, training_run_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.runs.training_run(training_run_id, tenant)

    @api.get("/api/v1/training_runs/{training_run_id}/checkpoints")
    async def list_checkpoints(self, training_run_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.runs.checkpoints(training_run_id, tenant)

    # A checkpoint id has a slash in it (weights/<name>), and the SDK sends it unescaped. These routes come before
    # the bare DELETE of a checkpoint, whose {checkpoint_id:path} would also match their longer paths.
    @api.get("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(self, training_run_id: str, checkpoint_id: str, request: Request,
                                    tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.checkpoints.external_urls(training_run_id, checkpoint_id, tenant,
                                                             str(request.base_url))

    @api.post("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
    async def publish_checkpoint(self, training_run_id: str, checkpoint_id: str,
                                 tenant: str = Depends(caller)) -> Response:
        await self._control.checkpoints.set_public(training_run_id, checkpoint_id, True, tenant)
        return Response(status_code=204)

    @api.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
    async def unpublish_checkpoint(self, training_run_id: str, checkpoint_id: str,
                                   tenant: str = Depends(caller)) -> Response:
        await self._control.checkpoints.set_public(training_run_id, checkpoint_id, False, tenant)
        return Response(status_code=204)

    @api.put("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/ttl", status_code=204)
    async def set_checkpoint_ttl(self, training_run_id: str, checkpoint_id: str, body: TtlRequest,
                                 tenant: str = Depends(caller)) -> Response:
        await self._control.checkpoints.set_ttl(training_run_id, checkpoint_id, body, tenant)
        return Response(status_code=204)

    @api.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str,
                                tenant: str = Depends(caller)) -> Response:
        await self._control.runs.delete_checkpoint(training_run_id, checkpoint_id, tenant)
        return Response(status_code=204)

    @api.get("/api/v1/checkpoints")
    async def list_user_checkpoints(self, limit: int = Query(100, ge=1, le=MAX_PAGE),
                                    offset: int = Query(0, ge=0, le=INT64_MAX),
                                    tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.runs.user_checkpoints(limit, offset, tenant)

    @api.post("/api/v1/weights_info")
    async def weights_info(self, body: TinkerPathRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.checkpoints.weights_info(body, tenant)

    @api.post("/api/v1/copy_weights")
    async def copy_weights(self, body: CopyWeightsRequest, request: Request,
                           tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.checkpoints.copy_weights(body, tenant, request.headers.get("x-idempotency-key"),
                                                            request.headers.get("x-tinker-weights-access-token"))

    # Signed download links (lilo.signed_urls): no API key; the signature is checked first.
    @api.get("/api/v1/downloads/{training_run_id}/external_weights/{name}/{file}", response_class=Response,
             responses={200: {"description": "the file's bytes",
                              "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}})
    async def download(self, training_run_id: str, name: str, file: str,
                       tenant: str = Query(max_length=MAX_ID_CHARS), expires: int = Query(ge=0, le=INT64_MAX),
                       signature: str = Query(max_length=128)) -> Response:
        size, chunks = await self._control.checkpoints.open_download(training_run_id, name, file, tenant, expires,
                                                                     signature)
        return StreamingResponse(chunks, media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    # --- sessions (RestClient; serve/tinker/sessions.py) ----------------------------------------------------------
    @api.get("/api/v1/sessions")
    async def list_sessions(self, limit: int = Query(20, ge=1, le=MAX_PAGE),
                            offset: int = Query(0, ge=0, le=INT64_MAX),
                            tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sessions.page(limit, offset, tenant)

    @api.post("/api/v1/sessions/search")
    async def search_sessions(self, body: SessionSearchRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sessions.search(body, tenant)

    @api.get("/api/v1/sessions/{session_id}")
    async def get_session(self, session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sessions.session(session_id, tenant)

    # --- what a self-hosted service does not keep: a 404 that says so (the SDK retries 5xx, so not 501) -------
    @api.put("/api/v1/sessions/{session_id}/project")
    async def assign_session_project(self, session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError(NO_PROJECTS)

    @api.get("/api/v1/sessions/{session_id}/trace_export")
    async def export_session_trace(self, session_id: str, request: Request,
                                   tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.session_traces.export(session_id, tenant, str(request.base_url))

    @api.get(TRACE_ROUTE + "/{session_id}", response_class=Response,
             responses={200: {"description": "the session's trace (Chrome trace-event JSON, which Perfetto opens)",
                              "content": {"application/json": {}}}})
    async def download_session_trace(self, session_id: str, tenant: str = Query(max_length=MAX_ID_CHARS),
                                     expires: int = Query(ge=0, le=INT64_MAX),
                                     signature: str = Query(max_length=128)) -> Response:
        return Response(await self._control.session_traces.download(session_id, tenant, expires, signature),
                        media_type="application/json")

    @api.get("/api/v1/audit")
    async def audit_log(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError("lilo keeps no audit log (it is self-hosted, with no organizations or teams); its own "
                            "log is <home>/lilo.log on the head node.")

    @api.get("/api/v1/billing/usage/events")
    async def billing_usage(self, starting_on: datetime.datetime, ending_before: datetime.datetime,
                            tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.billing_usage(starting_on, ending_before, tenant)

    @api.get("/api/v1/usage")
    async def usage(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        """The caller's usage: tokens trained and sampled, requests, execute seconds on the trainers (its share of
        coalesced passes), models held, requests in flight, checkpoint bytes, and its limits (docs/operations.md)."""
        return await self._control.runs.usage(tenant)

    @api.get("/api/v1/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.runs.storage_usage(tenant)

    @api.post("/api/v1/unload_model")
    async def unload_model(self, body: ModelRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.unload_model(body, tenant)

    @api.post("/api/v1/create_custom_loss")
    async def create_custom_loss(self, body: CreateCustomLossRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await self._control.training.custom_losses.create(body, tenant)

    @api.post("/api/v1/cancel_future")
    async def cancel_future(self, body: RetrieveFutureRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        await self._control.sampling.cancel(body.request_id, tenant)
        return {}

    @api.post("/api/v1/join_sampling_session")
    async def join_sampling_session(self, body: SamplingSessionRequest,
                                    tenant: str = Depends(caller)) -> dict[str, Any]:
        return await self._control.sampling.join(body, tenant)

    @api.get("/api/v1/timing")
    async def timing(
        self,
        model_id: str | None = Query(None, max_length=MAX_ID_CHARS, description="a model id; none: the cluster"),
        reset: bool = Query(False, description="start this reader's next interval now"),
        reader: str = Query("", max_length=MAX_ID_CHARS, description="whose interval reset refers to"),
        tenant: str = Depends(caller),
    ) -> dict[str, Any]:
        """Critical path of one of the caller's models (queue wait vs execute vs capture/persist, batch sharing),
        or the cluster's, summed over every model (no model ids in it)."""
        return await self._control.timing.snapshot(model_id, reset, reader, tenant)

    @api.get("/api/v1/console/overview")
    async def console_overview(
        self, reader: str = Query("", max_length=MAX_ID_CHARS, description="whose timing intervals to start anew"),
        tenant: str = Depends(caller),
    ) -> dict[str, Any]:
        """What the console (/console) shows: the caller's models (every tenant's for an admin) with their slot tier
        and critical path, the trainers, checkpoints and sessions (serve/console/overview.py)."""
        return await self._control.console.overview(tenant, reader)

    # --- the OpenAI-compatible endpoint (serve/openai/; docs/openai.md) ----------------------------------------
    @openai_route(api, "POST", "chat/completions")
    async def chat_completions(self, body: ChatCompletionBody, tenant: str = Depends(caller)) -> Response:
        return await self._control.openai.chat(body, tenant)

    @openai_route(api, "POST", "completions")
    async def completions(self, body: CompletionBody, tenant: str = Depends(caller)) -> Response:
        return await self._control.openai.completions(body, tenant)

    @openai_route(api, "GET", "models")
    async def openai_models(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        return self._control.openai.models()


def build_application(settings: Settings) -> serve.Application:
    """The Serve application for these settings, routing to the trainers of the registry; it gets the API keys
    (their digests) read now, and the path of the download links' signing secret (made now if missing; the secret
    itself never travels as a deployment argument)."""
    return LiloIngress.bind(list(settings.base_models), settings.trainer_wait_s, settings.max_body_mb << 20,
                            settings.api_key_digests(), str(secret_file(settings.home)), settings.compress_bodies,
                            [str(directory) for directory in settings.image_dirs], settings.storage)
