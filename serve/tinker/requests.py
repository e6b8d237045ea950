"""The bodies the routes take: pydantic models of the JSON ones (validated by FastAPI before a route runs), and the
protobuf ``forward_backward``, decoded here into the library's ``ForwardBackwardCall``. The ingress and the control
plane behind it both import them, so a request reaches the control plane as the type it was validated as.

(No ``from __future__ import annotations``: FastAPI reads these models' fields, and the routes' signatures that name
them, at runtime. Serve ships the ingress class by value, but this module is imported on its replicas by name.)
"""

from typing import Any, Literal

from fastapi import HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from lilo.futures.session_completions import CLONE_SPAN
from lilo.protocol.proto import ForwardBackwardCall, decode_forward_backward, inflate
from serve.http.limits import BodyLimit

MAX_ID_CHARS = 256
PROTOBUF = "application/x-protobuf"


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
    optimizer_config: dict[str, Any] | None = None  # its optimizer family (serve.tinker.optimizers)
    # Checked when the model is recorded (serve.tinker.submissions.metadata_strings), whose refusal says what to send.
    user_metadata: Any = None


class ModelRequest(Body):
    model_id: str = Field(max_length=MAX_ID_CHARS)


class SaveWeightsRequest(ModelRequest):
    seq_id: int = Field(ge=1)
    path: str | None = Field(None, max_length=MAX_ID_CHARS)
    ttl_seconds: int | None = None  # the checkpoint expires this long after the save (none: never)
    age_encryption_recipients: list[str] | None = None  # save_weights_external's; refused (see Training.save)
    # save_weights_for_sampler without a path: the sampling session the saved weights open
    sampling_session_seq_id: int | None = Field(None, ge=0)
    # "snapshot" (fixed weights) or "inflight" (the model's one mutable target, which later inflight saves update)
    kind: Literal["snapshot", "inflight"] = "snapshot"

    @property
    def opens_sampling_session(self) -> bool:
        """An ephemeral sampler save (the SDK's save_weights_and_get_sampling_client): no name, a session instead."""
        return self.path is None and self.sampling_session_seq_id is not None


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

    @property
    def loads_into_model(self) -> bool:
        return self.model_id is not None and self.seq_id is not None

    @property
    def creates_model(self) -> bool:
        return self.session_id is not None and self.model_seq_id is not None


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


class SamplingSessionTarget(Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = Field(max_length=MAX_ID_CHARS)
    cloned_sampler_id: int = Field(0, ge=0, lt=2**63 // CLONE_SPAN)


class RetrieveFuturesRequest(Body):
    """One poll of a sampling client's requests (the SDK's ``retrieve_futures``): what finished after
    ``prev_cursor``; ``timeout`` 0 answers at once, none long-polls."""
    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0, lt=2**63)
    timeout: float | None = Field(None, ge=0)
    # Results the client has read; lilo keeps them anyway until the ledger's retention prunes them, so that a
    # retried retrieve_future still finds its result.
    retrieved_request_ids: list[str] = Field(default_factory=list, max_length=100_000)


class SamplingSessionRequest(Body):
    sampling_session_id: str = Field(max_length=MAX_ID_CHARS)


class CreateCustomLossRequest(Body):
    session_id: str = Field(max_length=MAX_ID_CHARS)
    custom_loss_seq_id: int = Field(ge=0, lt=2**63)
    name: str = Field(max_length=MAX_ID_CHARS)
    # Checked by lilo.backend.training.loss_graph, whose refusals name what to change.
    inputs: list[dict[str, Any]] = Field(max_length=64)
    graph: dict[str, Any]


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
    # Another family's settings, with its "type" (DimuonParams): the SDK sends these instead of adam_params.
    optimizer_params: dict[str, Any] | None = None


async def read_forward_backward(request: Request) -> ForwardBackwardCall:
    """A forward_backward's protobuf body (the SDK sends no JSON one), inflated and decoded; 415 for another format."""
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise HTTPException(status_code=415, detail=f"forward_backward takes a {PROTOBUF} body.")
    body = await request.body()  # BodyLimit refuses a larger one before it is read whole
    return decode_forward_backward(inflate(body, request.headers.get("content-encoding"), BodyLimit.limit_bytes))
