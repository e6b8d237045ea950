"""Fuzzing every operation of the service's own OpenAPI schema (served at /openapi.json) with schemathesis, over real
HTTP on the session cluster: whatever a client sends, the answer comes within ANSWER_BOUND_S, is never a 5xx, every
4xx is a JSON body whose ``detail`` (on the OpenAI-compatible routes, ``error.message``) is a sentence, and
responses conform to the schema (status codes, content types, bodies; every 4xx is documented as ``ErrorBody``, or
on the OpenAI-compatible routes as ``OpenAIErrorBody``).

Two passes: schemathesis' valid (positive) and invalid (negative) requests, EXAMPLES per operation and mode; then
EDGE_EXAMPLES valid requests per operation with one value swapped for one that servers tend to choke on (integers
past 64 bits, NaN, unpaired surrogates, deep nesting; EDGE_VALUES), which found more than the first pass. Bounded for
CI: derandomized (the same examples every run), no shrinking, no example database, all to 127.0.0.1 only.

Kept from leaving state behind (other tests need the trainers' 16 adapter slots each, and a quiet database):
- create_session records a session for any JSON object, so it is fuzzed with invalid bodies only;
- a body naming a served base model (create_model, create_sampling_session, load_weights) gets an unserved one
  instead, so no fuzzed request places a model or opens a sampling session;
- every id a fuzzed body or path holds is random, so it names no model, run, session or checkpoint: the
  state-changing routes (save_weights[_external], unload_model, delete checkpoint, its TTL and publication,
  copy_weights, finishing a session, ...) answer 404 before they change anything, and a download link that lilo did
  not sign is a 403;
- retrieve_future's and cancel_future's request ids are moved past the small ones, which may name other tests'
  futures (a pending one long-polls for 40 s by design; a sample would be cancelled).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance,
)

from helpers import record_counts

API_KEY = {"X-API-Key": "tml-local-test"}
ANSWER_BOUND_S = 10.0
EXAMPLES = 12
EDGE_EXAMPLES = 50
UNSERVED_BASE_MODEL = "fuzz/not-served"
SMALL_REQUEST_IDS = 10**9  # request ids below this may be real futures of other tests

OPERATIONS = [
    "GET /api/v1/healthz",
    "POST /api/v1/client/config",
    "GET /api/v1/get_server_capabilities",
    "POST /api/v1/client/dynamic_config",
    "POST /api/v1/auth/token",
    "GET /api/v1/auth/apikey/me",
    "DELETE /api/v1/auth/apikey/me",
    "POST /api/v1/create_session",
    "POST /api/v1/session_heartbeat",
    "POST /api/v1/sessions/{session_id}/finish",
    "POST /api/v1/telemetry",
    "POST /api/v1/create_model",
    "POST /api/v1/get_info",
    "POST /api/v1/forward_backward",  # its body is protobuf, fuzzed in test_fuzz_protobuf.py; here: no body
    "POST /api/v1/optim_step",
    "POST /api/v1/save_weights",
    "POST /api/v1/save_weights_for_sampler",
    "POST /api/v1/save_weights_external",
    "POST /api/v1/create_sampling_session",
    "GET /api/v1/samplers/{sampling_session_id}",
    "POST /api/v1/asample",
    "POST /api/v1/load_weights",
    "GET /api/v1/training_runs",
    "GET /api/v1/training_runs/{training_run_id}",
    "GET /api/v1/training_runs/{training_run_id}/checkpoints",
    "GET /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/external_weights_urls",
    "POST /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish",
    "DELETE /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish",
    "PUT /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/ttl",
    "DELETE /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}",
    "GET /api/v1/checkpoints",
    "POST /api/v1/weights_info",
    "POST /api/v1/copy_weights",
    "GET /api/v1/downloads/{training_run_id}/external_weights/{name}/{file}",
    "GET /api/v1/sessions",
    "POST /api/v1/sessions/search",
    "GET /api/v1/sessions/{session_id}",
    "PUT /api/v1/sessions/{session_id}/project",
    "GET /api/v1/sessions/{session_id}/trace_export",
    "GET /api/v1/downloads/session_traces/{session_id}",
    "GET /api/v1/audit",
    "GET /api/v1/billing/usage/events",
    "GET /api/v1/billing/usage/checkpoints/current",
    "GET /api/v1/usage",
    "POST /api/v1/unload_model",
    "POST /api/v1/retrieve_future",
    "POST /api/v1/retrieve_futures",
    "POST /api/v1/cancel_future",
    "POST /api/v1/create_custom_loss",
    "POST /api/v1/join_sampling_session",
    "GET /api/v1/timing",
    "GET /api/v1/console/overview",
    # The OpenAI-compatible endpoint (docs/openai.md): its errors are in OpenAI's shape (``error.message``); a fuzzed
    # model names no served model or checkpoint, so nothing is sampled.
    "POST /oai/api/v1/chat/completions",
    "POST /oai/api/v1/completions",
    "GET /oai/api/v1/models",
]
# Operations whose every valid request creates a record: fuzzed with invalid requests only.
INVALID_ONLY = {"POST /api/v1/create_session"}
# Operations that take no JSON body and no parameter but free-form strings in the path: there is no invalid
# request to make of them.
CHECKPOINT = "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}"
NO_INVALID = {"GET /api/v1/healthz", "POST /api/v1/client/config", "GET /api/v1/get_server_capabilities",
              "POST /api/v1/client/dynamic_config", "POST /api/v1/telemetry", "POST /api/v1/forward_backward",
              "POST /api/v1/auth/token", "GET /api/v1/auth/apikey/me", "DELETE /api/v1/auth/apikey/me",
              "GET /api/v1/samplers/{sampling_session_id}",
              "GET /api/v1/training_runs/{training_run_id}", "GET /api/v1/training_runs/{training_run_id}/checkpoints",
              f"DELETE {CHECKPOINT}", f"GET {CHECKPOINT}/external_weights_urls", f"POST {CHECKPOINT}/publish",
              f"DELETE {CHECKPOINT}/publish", "GET /api/v1/sessions/{session_id}",
              "PUT /api/v1/sessions/{session_id}/project", "GET /api/v1/sessions/{session_id}/trace_export",
              "GET /api/v1/audit", "GET /api/v1/billing/usage/checkpoints/current",
              "GET /api/v1/usage", "GET /oai/api/v1/models"}
RUNS = [(label, mode) for label in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if not (mode is GenerationMode.POSITIVE and label in INVALID_ONLY)
        and not (mode is GenerationMode.NEGATIVE and label in NO_INVALID)]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def records_before(local_cluster) -> dict[str, int]:
    return record_counts(local_cluster.settings.futures_db)


@pytest.fixture(scope="module")
def api_schema(local_cluster, records_before) -> schemathesis.BaseSchema:
    raw = httpx.get(f"{local_cluster.api_url}/openapi.json", headers=API_KEY, timeout=30).raise_for_status().json()
    return schemathesis.openapi.from_dict(raw)


def test_the_fuzzed_operations_are_every_operation_the_service_serves(api_schema):
    paths = api_schema.raw_schema["paths"]
    served = {f"{method.upper()} {path}": operation for path, methods in paths.items()
              for method, operation in methods.items()}
    assert sorted(served) == sorted(OPERATIONS), "a new route: add it to OPERATIONS, and say if it creates state"
    assert {label for label, operation in served.items() if not can_be_invalid(operation)} == NO_INVALID


def can_be_invalid(operation: dict[str, Any]) -> bool:
    """Whether some request to this operation breaks its schema: it has a body, or a parameter that is not a
    free-form path string."""
    free_path_string = {"type", "title"}
    return "requestBody" in operation or any(
        parameter["in"] != "path" or set(parameter["schema"]) - free_path_string
        or parameter["schema"]["type"] != "string" for parameter in operation.get("parameters", []))


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{label}-{mode.value}" for label, mode in RUNS])
def test_fuzzed_requests_get_a_prompt_answer_and_never_a_server_error(local_cluster, api_schema, label, mode):
    method, path = label.split(" ", 1)
    served = set(local_cluster.base_models)

    @bounded(EXAMPLES)
    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        keep_stateless(path, case.body, served)
        started = time.monotonic()
        try:
            response = case.call(base_url=local_cluster.api_url, headers=API_KEY, timeout=ANSWER_BOUND_S)
        except Exception as error:  # requests' timeout among them: a hang is a failure
            raise AssertionError(f"{label} did not answer within {ANSWER_BOUND_S} s: {error!r}") from None
        assert urlsplit(response.request.url).hostname == "127.0.0.1"
        content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps a list per header
        assert_answered_well(label, response.status_code, content_type, response.text, time.monotonic() - started)
        case.validate_response(response, checks=CHECKS + ([negative_data_rejection] if mode.is_negative else []))

    fuzz()


@pytest.mark.parametrize("label", sorted(set(OPERATIONS) - NO_INVALID - INVALID_ONLY))
def test_valid_requests_with_one_edge_value_get_a_prompt_answer_and_never_a_server_error(local_cluster, api_schema,
                                                                                        label):
    """Schema-valid requests with one value swapped for one the schema allows or not, but a server may choke on:
    integers past 64 bits, NaN, unpaired surrogates, deep nesting, NUL, huge strings. (Sent by hand: the SDK's JSON
    encoder and schemathesis' refuse NaN.)"""
    method, path = label.split(" ", 1)
    served = set(local_cluster.base_models)

    with httpx.Client(base_url=local_cluster.api_url, headers=API_KEY, timeout=ANSWER_BOUND_S) as http:
        @bounded(EDGE_EXAMPLES)
        @given(request=with_an_edge_value(api_schema[path][method].as_strategy(), served))
        def fuzz(request: tuple[schemathesis.Case, bytes | None, dict[str, Any]]) -> None:
            case, content, query = request
            started = time.monotonic()
            try:
                response = http.request(method, case.formatted_path, params=query, content=content,
                                        headers={"Content-Type": "application/json"})
            except httpx.TimeoutException:
                raise AssertionError(f"{label} did not answer within {ANSWER_BOUND_S} s: {content!r:.300}") from None
            assert response.url.host == "127.0.0.1"
            assert_answered_well(label, response.status_code, response.headers.get("content-type", ""),
                                 response.text, time.monotonic() - started)

        fuzz()


def bounded(examples: int):
    """Hypothesis settings for CI: this many examples, the same ones every run, no shrinking, no database."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck), print_blob=False)


@st.composite
def with_an_edge_value(draw, cases: st.SearchStrategy[schemathesis.Case], served: set[str]):
    """(case, its JSON body as sent, its query) with one body value or query parameter replaced by an edge value."""
    case = draw(cases)
    if case.body is NOT_SET:
        return case, None, {key: draw(st.sampled_from(EDGE_TEXTS)) for key in case.query or {}}
    body = copy.deepcopy(case.body)
    query = dict(case.query or {})
    spots = list(json_spots(body))
    if query and (not spots or draw(st.booleans())):
        query[draw(st.sampled_from(sorted(query)))] = draw(st.sampled_from(EDGE_TEXTS))
    elif spots:
        container, key = draw(st.sampled_from(spots))
        container[key] = draw(st.sampled_from(EDGE_VALUES))
    keep_stateless(case.operation.path, body, served)
    return case, json.dumps(body).encode(), query


def json_spots(value: Any) -> Iterator[tuple[dict | list, Any]]:
    """(container, key) of every value inside a JSON document."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield value, key
            yield from json_spots(child)
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield value, index
            yield from json_spots(child)


def nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


EDGE_VALUES = [2**63, 2**64, -2**63 - 1, 10**30, 1e300, -1, 0, True, None, float("nan"), float("inf"), "\ud800",
               "\x00", "", "x" * 5000, "../../../etc/passwd", "tinker://x/weights/..", [], {}, nested_lists(300)]
EDGE_TEXTS = [str(2**63), str(10**30), "-1", "1e400", "nan", "\x00", "", "x" * 5000]


def keep_stateless(path: str, body: Any, served: set[str]) -> None:
    """Rewrite the few generated values that could change the cluster's state (see the module docstring)."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("base_model"), str) and body["base_model"] in served:
        body["base_model"] = UNSERVED_BASE_MODEL
    if path in ("/api/v1/retrieve_future", "/api/v1/cancel_future") and isinstance(body.get("request_id"), str):
        try:
            small = 0 < int(body["request_id"]) < SMALL_REQUEST_IDS
        except ValueError:
            small = False
        if small:
            body["request_id"] = str(int(body["request_id"]) + SMALL_REQUEST_IDS)


def assert_answered_well(label: str, status: int, content_type: str, text: str, elapsed_s: float) -> None:
    assert elapsed_s < ANSWER_BOUND_S, f"{label} took {elapsed_s:.1f} s"
    assert status < 500, f"{label} answered {status}: {text[:500]}"
    if 400 <= status < 500:
        assert content_type.startswith("application/json"), f"{label} {status} as {content_type}: {text[:500]}"
        body = json.loads(text)
        # OpenAI's error shape on its routes, else lilo's own.
        detail = body.get("error", {}).get("message") if " /oai/" in label else body.get("detail")
        assert isinstance(detail, str) and len(detail.split()) >= 3, (
            f"{label} {status} without a sentence: {text[:500]}")


def test_the_fuzzing_recorded_nothing(local_cluster, records_before):
    """Runs last in this module: no fuzzed request left a future, model, session or sampling session behind."""
    assert record_counts(local_cluster.settings.futures_db) == records_before
