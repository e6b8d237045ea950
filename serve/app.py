"""The FastAPI ingress, deployed on Ray Serve, that speaks the Tinker HTTP API under /api/v1.

(No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime, and through
Serve's ingress wrapper string annotations of body models do not resolve.)
"""

import contextlib
import sys
from pathlib import Path
from typing import Any, Literal

import ray
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import RayActorError

from cluster.futures_actor import FUTURES_ACTOR_NAME, RETRIEVE_TIMEOUT_S
from cluster.local import NAMESPACE
from cluster.placement import named_actor
from cluster.timing import get_timing_actor
from cluster.unloading import unload_model
from cluster.worker_setup import freeze_startup

from lilo import __version__
from lilo.api_keys import ApiKeys
from lilo.backend.registry import base_model_spec
from lilo.settings import Settings
from lilo.engine.commands import Kind
from lilo.errors import InvalidRequestError, NotFoundError
from lilo.backend.checkpoint_paths import TINKER_SCHEME, parse_tinker_path
from lilo.futures.schema import PENDING
from lilo.futures.store import FutureState, unloaded_error
from lilo.timing.phase_stats import ALL_MODELS
from lilo.protocol.proto import decode_forward_backward, inflate
from lilo.signed_urls import DownloadGrant, read_secret, secret_file
from serve import checkpoints, runs, sampling, sessions, training
from serve.auth import ApiKeyGate, caller
from serve.errors import ERROR_RESPONSES, install_error_handlers
from serve.direct_ingress import reuse_listening_address
from serve.heartbeats import SessionBeats
from serve.json_body import INT64_MAX, StrictJsonRoute
from serve.limits import BodyLimit, JsonOnly

APP_NAME = "lilo"
INGRESS_NAME = "LiloIngress"
MAX_ID_CHARS = 256
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
api.add_middleware(ApiKeyGate)  # added last, so it runs first: nothing of an unauthenticated request is read


PROTOBUF = "application/x-protobuf"
# Results the SDK accepts only as protobuf.
PROTOBUF_RESULTS = {Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.SAMPLE}


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # the SDK adds fields over versions; unknown ones are ignored


class RetrieveFutureRequest(Body):
    request_id: str = Field(max_length=MAX_ID_CHARS)
    allow_metadata_only: bool = False


class SessionRequest(Body):
    session_id: str = Field(max_length=MAX_ID_CHARS)


class CreateModelRequest(Body):
    session_id: str = Field(max_length=MAX_ID_CHARS)
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(max_length=MAX_ID_CHARS)
    lora_config: dict[str, Any] | None = None


class ModelRequest(Body):
    model_id: str = Field(max_length=MAX_ID_CHARS)


class SaveWeightsRequest(ModelRequest):
    seq_id: int = Field(ge=1)
    path: str | None = Field(None, max_length=MAX_ID_CHARS)
    ttl_seconds: int | None = None  # the checkpoint expires this long after the save (none: never)
    age_encryption_recipients: list[str] | None = None  # save_weights_external's; refused (see submit_save)
    # save_weights_for_sampler without a path: the sampling session the saved weights open
    sampling_session_seq_id: int | None = Field(None, ge=0)


class LoadWeightsRequest(Body):
    # Either model_id + seq_id (load into a model), or session_id + model_seq_id (create a model by loading).
    model_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    seq_id: int | None = Field(None, ge=1)
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = Field(None, max_length=MAX_ID_CHARS)
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None
    path: str = Field(max_length=4 * MAX_ID_CHARS)
    optimizer: bool = True


class CreateSamplingSessionRequest(SessionRequest):
    sampling_session_seq_id: int = Field(ge=0)
    model_path: str | None = Field(None, max_length=4 * MAX_ID_CHARS)
    base_model: str | None = Field(None, max_length=MAX_ID_CHARS)


class SamplingParams(Body):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None


class SampleRequest(Body):
    sampling_session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    seq_id: int = Field(ge=0)
    num_samples: int = 1
    prompt: dict[str, Any]
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    # Record each returned sequence for training with stable_reinforce (sequence ids: sample_sequence_ids).
    record_stability_info: bool | None = None


class TtlRequest(Body):
    ttl_seconds: int | None = None


class TinkerPathRequest(Body):
    tinker_path: str = Field(max_length=4 * MAX_ID_CHARS)


class CopyWeightsRequest(Body):
    source_path: str = Field(max_length=4 * MAX_ID_CHARS)
    destination_project_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    model_seq_id: int | None = Field(None, ge=0)
    ttl_seconds: int | None = None
    weights_access_token: str | None = Field(None, max_length=MAX_ID_CHARS)


class SessionSearchOwner(Body):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(None, min_length=1, max_length=10)


class SessionStatusQuery(Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1)


class SessionSearchCursor(Body):
    last_created_at: str = Field(max_length=64)
    last_session_id: str = Field(max_length=MAX_ID_CHARS)


class SessionSearchRequest(Body):
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    owner: SessionSearchOwner = Field(default_factory=SessionSearchOwner)
    statuses: list[SessionStatusQuery] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: SessionSearchCursor | None = None


class FinishSessionRequest(Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class OptimStepRequest(ModelRequest):
    seq_id: int = Field(ge=1)
    adam_params: dict[str, Any] = Field(default_factory=dict)


def timing_record(model_id: str) -> str | None:
    """The record whose tenant owns timing under ``model_id``: a model or sampling session of that id, or for a
    sampler checkpoint's path (how samples through it are timed) the model that saved it; None: no record can.
    (Defined above the ingress: Serve ships that class by value, with only the names defined before it.)"""
    if not model_id.startswith(TINKER_SCHEME):
        return model_id
    try:
        return parse_tinker_path(model_id)[0]
    except InvalidRequestError:
        return None


# On the head node (Ray gives it this resource), beside the futures DB actor it calls on every request: a worker node
# that leaves never takes the ingress along, which would leave clients without one until Serve placed another.
HEAD_NODE = {"node:__internal_head__": 0.001}
GIL_SWITCH_INTERVAL_S = 0.001


@serve.deployment(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
                  max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress(api)
class LiloIngress:
    """Stateless HTTP front: several replicas may run; everything stateful lives in actors behind it."""

    def __init__(self, base_models: list[str], trainers: list[str], max_body_bytes: int,
                 api_key_digests: dict[str, str], url_secret_file: str) -> None:
        reuse_listening_address()  # before Serve binds lilo's port in this replica
        # Serve's HTTP loop, the loop running these routes and Ray's threads hand each request to one another; a
        # waiting thread gets the GIL within 1 ms instead of CPython's 5 (bench_load's heartbeat p99: 47-49 ms
        # against 50-52 ms).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        BodyLimit.limit_bytes = max_body_bytes
        ApiKeyGate.keys = ApiKeys(api_key_digests)
        self._timing = get_timing_actor()
        self._futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
        self._base_models = list(base_models)
        self._trainers = list(trainers)
        self._sampling = sampling.SamplingRouter(self._futures, trainers)
        self._sessions = SessionBeats(self._futures)
        self._url_secret = read_secret(Path(url_secret_file))
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
        freeze_startup()

    @api.get("/api/v1/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    # The first call the tinker SDK makes; {} means "use the SDK's defaults" for every feature flag.
    @api.post("/api/v1/client/config")
    async def client_config(self) -> dict[str, Any]:
        return {}

    @api.get("/api/v1/get_server_capabilities")
    async def get_server_capabilities(self) -> dict[str, Any]:
        return self._capabilities

    @api.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(self) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @api.post("/api/v1/create_session")
    async def create_session(self, body: Body, tenant: str = Depends(caller)) -> dict[str, Any]:
        session_id = training.new_session_id()
        await self._futures.add_session.remote(session_id, tenant=tenant, info=body.model_dump())
        return {"session_id": session_id, "type": "create_session"}

    @api.post("/api/v1/session_heartbeat")
    async def session_heartbeat(self, body: SessionRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        await self._sessions.beat(body.session_id, tenant)
        return {"type": "session_heartbeat"}

    @api.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(self, session_id: str, body: FinishSessionRequest | None = None,
                             tenant: str = Depends(caller)) -> dict[str, Any]:
        finished = (body or FinishSessionRequest()).model_dump(include={"reason", "detail"})
        await self._futures.record_session_finish.remote(session_id, tenant, finished)
        await training.finish_session(self._futures, session_id, tenant)
        return {}

    @api.post("/api/v1/telemetry")
    async def telemetry(self) -> dict[str, str]:
        return {"status": "accepted"}

    @api.post("/api/v1/create_model")
    async def create_model(self, body: CreateModelRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        if body.base_model not in self._base_models:
            raise InvalidRequestError(
                f"base_model {body.base_model!r} is not served here; use one of {', '.join(self._base_models)}.")
        return await training.create_model(self._futures, self._trainers, body.model_dump(), tenant=tenant)

    @api.post("/api/v1/get_info")
    async def get_info(self, body: ModelRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        model = await self._futures.model.remote(body.model_id, tenant)
        if model["unloaded_at"] is not None:
            raise unloaded_error(body.model_id, model["unloaded_reason"])
        base = model["base_model"]
        return {"model_id": body.model_id, "model_data": {"arch": "llama", "model_name": base, "tokenizer_id": base},
                "is_lora": True, "lora_rank": model["lora_config"].get("rank"), "model_name": base,
                "type": "get_info"}

    @api.post("/api/v1/forward_backward")
    async def forward_backward(self, request: Request, tenant: str = Depends(caller)) -> dict[str, str]:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise HTTPException(status_code=415, detail=f"forward_backward takes a {PROTOBUF} body.")
        body = await request.body()  # BodyLimit refuses a larger one before it is read whole
        call = decode_forward_backward(inflate(body, request.headers.get("content-encoding"), BodyLimit.limit_bytes))
        return await training.submit_forward_backward(self._futures, call, tenant=tenant)

    @api.post("/api/v1/optim_step")
    async def optim_step(self, body: OptimStepRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await training.submit_optim_step(self._futures, body.model_dump(), tenant=tenant)

    @api.post("/api/v1/save_weights")
    async def save_weights(self, body: SaveWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await training.submit_save(self._futures, body.model_dump(), Kind.SAVE_WEIGHTS, tenant=tenant)

    @api.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(self, body: SaveWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        if body.path is None and body.sampling_session_seq_id is not None:
            return await sampling.submit_ephemeral_save(self._futures, body.model_dump(), tenant=tenant)
        return await training.submit_save(self._futures, body.model_dump(), Kind.SAVE_WEIGHTS_FOR_SAMPLER,
                                          tenant=tenant)

    @api.post("/api/v1/save_weights_external")
    async def save_weights_external(self, body: SaveWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        """The adapter as a PEFT directory (adapter_config.json, adapter_model.safetensors) to download through
        get_external_weights_urls' signed links."""
        return await training.submit_save(self._futures, body.model_dump(), Kind.SAVE_WEIGHTS_EXTERNAL, tenant=tenant)

    @api.post("/api/v1/create_sampling_session")
    async def create_sampling_session(self, body: CreateSamplingSessionRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await sampling.create_sampling_session(self._futures, self._sampling, body.model_dump(), tenant)

    @api.get("/api/v1/samplers/{sampling_session_id}")
    async def get_sampler(self, sampling_session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await sampling.sampler(self._futures, sampling_session_id, tenant)

    @api.post("/api/v1/asample")
    async def asample(self, body: SampleRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await sampling.submit_sample(self._futures, self._sampling, body.model_dump(), tenant=tenant)

    @api.post("/api/v1/load_weights")
    async def load_weights(self, body: LoadWeightsRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        into_model = body.model_id is not None and body.seq_id is not None
        creating = body.session_id is not None and body.model_seq_id is not None
        if into_model == creating:
            raise InvalidRequestError("load_weights takes either model_id and seq_id (load into that model) or "
                                      "session_id and model_seq_id (create a model from the checkpoint).")
        if creating:
            return await training.create_model_from_checkpoint(self._futures, self._trainers, body.model_dump(),
                                                               tenant=tenant)
        return await training.submit_load(self._futures, body.model_dump(), tenant=tenant)

    # --- training runs, checkpoints and unloading (RestClient / CLI; serve/runs.py) -----------------------
    @api.get("/api/v1/training_runs")
    async def list_training_runs(self, limit: int = Query(20, ge=1, le=MAX_PAGE),
                                 # SQLite's OFFSET takes 64-bit integers (JSON bodies: serve/json_body.py)
                                 offset: int = Query(0, ge=0, le=INT64_MAX),
                                 tenant: str = Depends(caller)) -> dict[str, Any]:
        # access_scope and project_id (also sent) change nothing here: a tenant sees its own runs, in one project.
        return await runs.list_training_runs(self._futures, self._trainers, limit, offset, tenant)

    @api.get("/api/v1/training_runs/{training_run_id}")
    async def get_training_run(self, training_run_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await runs.get_training_run(self._futures, self._trainers, training_run_id, tenant)

    @api.get("/api/v1/training_runs/{training_run_id}/checkpoints")
    async def list_checkpoints(self, training_run_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await runs.list_checkpoints(self._futures, self._trainers, training_run_id, tenant)

    # A checkpoint id has a slash in it (weights/<name>), and the SDK sends it unescaped. These routes come before
    # the bare DELETE of a checkpoint, whose {checkpoint_id:path} would also match their longer paths.
    @api.get("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(self, training_run_id: str, checkpoint_id: str, request: Request,
                                    tenant: str = Depends(caller)) -> dict[str, Any]:
        return await checkpoints.external_urls(self._futures, self._trainers, training_run_id, checkpoint_id, tenant,
                                               str(request.base_url), self._url_secret)

    @api.post("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
    async def publish_checkpoint(self, training_run_id: str, checkpoint_id: str,
                                 tenant: str = Depends(caller)) -> Response:
        await checkpoints.set_public(self._futures, self._trainers, training_run_id, checkpoint_id, True, tenant)
        return Response(status_code=204)

    @api.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/publish", status_code=204)
    async def unpublish_checkpoint(self, training_run_id: str, checkpoint_id: str,
                                   tenant: str = Depends(caller)) -> Response:
        await checkpoints.set_public(self._futures, self._trainers, training_run_id, checkpoint_id, False, tenant)
        return Response(status_code=204)

    @api.put("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/ttl", status_code=204)
    async def set_checkpoint_ttl(self, training_run_id: str, checkpoint_id: str, body: TtlRequest,
                                 tenant: str = Depends(caller)) -> Response:
        await checkpoints.set_ttl(self._futures, self._trainers, training_run_id, checkpoint_id, body.ttl_seconds,
                                  tenant)
        return Response(status_code=204)

    @api.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str, tenant: str = Depends(caller)) -> Response:
        await runs.delete_checkpoint(self._futures, self._trainers, training_run_id, checkpoint_id, tenant)
        return Response(status_code=204)

    @api.get("/api/v1/checkpoints")
    async def list_user_checkpoints(self, limit: int = Query(100, ge=1, le=MAX_PAGE),
                                    offset: int = Query(0, ge=0, le=INT64_MAX),
                                    tenant: str = Depends(caller)) -> dict[str, Any]:
        return await runs.list_user_checkpoints(self._futures, self._trainers, limit, offset, tenant)

    @api.post("/api/v1/weights_info")
    async def weights_info(self, body: TinkerPathRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await checkpoints.weights_info(self._futures, self._trainers, body.tinker_path, tenant)

    @api.post("/api/v1/copy_weights")
    async def copy_weights(self, body: CopyWeightsRequest, request: Request,
                           tenant: str = Depends(caller)) -> dict[str, str]:
        if body.weights_access_token or request.headers.get("x-tinker-weights-access-token"):
            raise InvalidRequestError("lilo has no weights access tokens; a checkpoint another tenant published is "
                                      "readable by its tinker path as it is. Leave weights_access_token out.")
        if (body.session_id is None) != (body.model_seq_id is None):
            raise InvalidRequestError("copy_weights takes session_id with model_seq_id, or neither (then the copy "
                                      "goes to a new training run of its own).")
        return await checkpoints.copy_weights(self._futures, self._trainers, body.model_dump(), tenant,
                                              request.headers.get("x-idempotency-key"))

    # Signed download links (lilo.signed_urls): no API key; the signature is checked first.
    @api.get("/api/v1/downloads/{training_run_id}/external_weights/{name}/{file}", response_class=Response,
             responses={200: {"description": "the file's bytes",
                              "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}})
    async def download(self, training_run_id: str, name: str, file: str,
                       tenant: str = Query(max_length=MAX_ID_CHARS), expires: int = Query(ge=0, le=INT64_MAX),
                       signature: str = Query(max_length=128)) -> Response:
        grant = DownloadGrant(tenant, f"{TINKER_SCHEME}{training_run_id}/external_weights/{name}", file, expires)
        size, chunks = await checkpoints.open_download(self._futures, self._trainers, grant, signature,
                                                       self._url_secret)
        return StreamingResponse(chunks, media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    # --- sessions (RestClient; serve/sessions.py) ----------------------------------------------------------
    @api.get("/api/v1/sessions")
    async def list_sessions(self, limit: int = Query(20, ge=1, le=MAX_PAGE),
                            offset: int = Query(0, ge=0, le=INT64_MAX),
                            tenant: str = Depends(caller)) -> dict[str, Any]:
        return await sessions.list_sessions(self._futures, limit, offset, tenant)

    @api.post("/api/v1/sessions/search")
    async def search_sessions(self, body: SessionSearchRequest, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await sessions.search_sessions(self._futures, self._trainers, body.model_dump(), tenant)

    @api.get("/api/v1/sessions/{session_id}")
    async def get_session(self, session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await sessions.get_session(self._futures, session_id, tenant)

    # --- what a self-hosted service does not keep: a 404 that says so (the SDK retries 5xx, so not 501) -------
    @api.put("/api/v1/sessions/{session_id}/project")
    async def assign_session_project(self, session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError(NO_PROJECTS)

    @api.get("/api/v1/sessions/{session_id}/trace_export")
    async def export_session_trace(self, session_id: str, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError("lilo does not export session traces; the critical path of each model is at "
                            "GET /api/v1/timing?model_id=... instead.")

    @api.get("/api/v1/audit")
    async def audit_log(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError("lilo keeps no audit log (it is self-hosted, with no organizations or teams); its own "
                            "log is <home>/lilo.log on the head node.")

    @api.get("/api/v1/billing/usage/events")
    async def billing_usage(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        raise NotFoundError("lilo is self-hosted and bills nobody, so it keeps no billing usage; the tokens each "
                            "model trained on are in GET /api/v1/timing.")

    @api.get("/api/v1/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(self, tenant: str = Depends(caller)) -> dict[str, Any]:
        return await runs.storage_usage(self._futures, self._trainers, tenant)

    @api.post("/api/v1/unload_model")
    async def unload_model(self, body: ModelRequest, tenant: str = Depends(caller)) -> dict[str, str]:
        return await unload_model(self._futures, body.model_id, tenant)

    @api.post("/api/v1/retrieve_future", response_model=None)
    async def retrieve_future(self, body: RetrieveFutureRequest, tenant: str = Depends(caller)) -> Response | dict[str, Any]:
        """Long-poll one future: its result once finished, else ``try_again`` (the SDK re-polls at once)."""
        try:
            state = await self._futures.retrieve.remote(body.request_id, RETRIEVE_TIMEOUT_S, tenant)
        except RayActorError:
            # The futures DB is restarting (its file keeps every result): the client polls again, as for pending.
            state = FutureState(0, PENDING)
        if state.status == "pending":
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if state.status == "failed":
            return {"error": state.error, "category": state.category or "server"}
        media_type = PROTOBUF if state.kind in PROTOBUF_RESULTS else "application/json"
        return Response(content=state.result, media_type=media_type)

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
        # Readers are per tenant: one tenant's reset never takes another's interval (nor lilo's own readers').
        snapshot = await self._timing_snapshot(model_id, reset, f"{tenant}/{reader}", tenant)
        if snapshot is None:
            raise HTTPException(
                status_code=404,
                detail=f"Unknown model_id {model_id!r}: no trainer has reported timing for it. "
                "Pass the model_id that create_model returned, or leave model_id out for the cluster-wide view.",
            )
        return snapshot

    async def _timing_snapshot(self, model_id: str | None, reset: bool, reader: str,
                               tenant: str) -> dict[str, Any] | None:
        """A placed model's timing comes fresh from the trainer that holds it; everything else (the cluster view, a
        model no trainer holds any more) from the timing actor's merged view. Another tenant's model is one without
        timing."""
        if model_id == ALL_MODELS:
            model_id = None
        if model_id is not None:
            record = timing_record(model_id)
            record_tenant, trainer = await self._futures.tenant_and_trainer_of.remote(record) if record else (None, None)
            if record_tenant != tenant:
                return None
            if trainer is not None:
                with contextlib.suppress(RayActorError):  # its trainer is restarting: the merged view has it
                    snapshot = await named_actor(trainer).timing.remote(model_id, reset, reader)
                    if snapshot is not None:
                        return snapshot
        try:
            return await self._timing.snapshot.remote(model_id, reset, reader)
        except RayActorError:
            # The detached actor was restarted or re-created: look it up again by name, once.
            self._timing = get_timing_actor()
            return await self._timing.snapshot.remote(model_id, reset, reader)


def build_application(settings: Settings, trainers: list[str]) -> serve.Application:
    """The Serve application for these settings, routing to these trainer actors; it gets the API keys (their
    digests) read now, and the path of the download links' signing secret (made now if missing; the secret itself
    never travels as a deployment argument)."""
    return LiloIngress.bind(list(settings.base_models), trainers, settings.max_body_mb << 20,
                            settings.api_key_digests(), str(secret_file(settings.home)))
