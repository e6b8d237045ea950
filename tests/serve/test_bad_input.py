"""Bad input over real HTTP on the session cluster: each request here got a 500, or a 4xx without a sentence, before
(found by the fuzz tests, test_fuzz_*.py, or while writing them) and is now a 4xx whose ``detail`` says what to
change. Plus the body gates: a 415 for a body that is not JSON on every JSON route, a 413 from the declared size
alone, and a 413 for a zstd body that inflates past the limit."""

import socket

import httpx
import pytest
import zstandard

from helpers import retrieve_finished, unload_models
from lilo.protocol.proto import pb
from serve.app import api as ingress_api

API_KEY = {"X-API-Key": "tml-local-test"}
JSON = {**API_KEY, "Content-Type": "application/json"}
PROTOBUF = {**API_KEY, "Content-Type": "application/x-protobuf"}


def post(cluster, route: str, content: bytes, headers=JSON) -> httpx.Response:
    return httpx.post(f"{cluster.api_url}/api/v1/{route}", content=content, headers=headers, timeout=30)


def assert_refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["detail"], response.text


@pytest.mark.parametrize(("route", "body", "words"), [
    # SQLite could not encode the unpaired surrogate.
    ("get_info", b'{"model_id": "\\ud800"}', "not valid JSON: no low surrogate"),
    # orjson could not store the session's info nested this deep.
    ("create_session", b'{"tags": ' + b"[" * 300 + b"]" * 300 + b"}", "not valid JSON: it nests deeper"),
    # float() of the learning rate overflowed.
    ("optim_step", b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": 1' + b"0" * 400 + b"}}",
     "not valid JSON"),
    # FastAPI's own 422 echoed the NaN back and could not encode it.
    ("create_sampling_session", b'{"session_id": NaN, "sampling_session_seq_id": 0}', "not valid JSON"),
])
def test_json_the_service_could_not_store_is_a_422(local_cluster, route, body, words):
    assert_refused(post(local_cluster, route, body), 422, words)


def test_an_offset_past_64_bits_is_a_422(local_cluster):
    # SQLite's OFFSET overflowed (a 500); found by the schema fuzzer.
    response = httpx.get(f"{local_cluster.api_url}/api/v1/training_runs", params={"offset": str(10**30)},
                         headers=API_KEY, timeout=30)
    assert_refused(response, 422, "query.offset: Input should be less than or equal to 9223372036854775807")


def test_a_validation_error_and_an_unknown_route_are_sentences(local_cluster):
    assert_refused(post(local_cluster, "get_info", b"{}"), 422, "The request is not valid: body.model_id: Field "
                                                               "required.")
    assert_refused(post(local_cluster, "no_such_route", b"{}"), 404, "There is no /api/v1/no_such_route here")


def test_token_bytes_that_are_not_whole_int32s_are_a_422(local_cluster):
    # numpy refused the buffer (a 500); found by the protobuf fuzzer.
    request = pb.ForwardBackwardRequest(model_id="fuzz:train:0", seq_id=1)
    request.data.add().model_input.add().encoded_text.tokens = b"abc"
    assert_refused(post(local_cluster, "forward_backward", request.SerializeToString(), PROTOBUF), 422,
                   "not a whole number of int32 token ids")


def test_a_zstd_body_that_inflates_past_the_limit_is_a_413_and_a_cut_one_a_422(local_cluster):
    compressor, zeros = zstandard.ZstdCompressor().compressobj(), bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(65)) + compressor.flush()  # 65 MiB inflated
    zstd = {**PROTOBUF, "Content-Encoding": "zstd"}
    assert_refused(post(local_cluster, "forward_backward", bomb, zstd), 413, "inflates past this server's limit")
    whole = zstandard.ZstdCompressor().compress(pb.ForwardBackwardRequest(model_id="m", seq_id=1).SerializeToString())
    assert_refused(post(local_cluster, "forward_backward", whole[:-2], zstd), 422, "ends in the middle of a frame")


@pytest.fixture(scope="module")
def session_id(local_cluster) -> str:
    created = post(local_cluster, "create_session", b"{}")
    assert created.status_code == 200, created.text
    return created.json()["session_id"]


def test_a_float_lora_seed_is_a_422_and_creates_no_model(local_cluster, session_id):
    # It was accepted, took an adapter slot, and failed on the trainer as a "server" error (torch's manual_seed).
    body = (b'{"session_id": "%s", "model_seq_id": 0, "base_model": "%s", "lora_config": {"rank": 4, "seed": 1.5}}'
            % (session_id.encode(), local_cluster.base_models[0].encode()))
    assert_refused(post(local_cluster, "create_model", body), 422, "integer seed")
    assert post(local_cluster, "get_info", b'{"model_id": "%s:train:0"}' % session_id.encode()).status_code == 404


def test_a_malformed_prompt_is_a_422(local_cluster, session_id):
    # Found with a real sampling session (the schema fuzzer's random ids stop at "unknown sampling session").
    opened = post(local_cluster, "create_sampling_session", b'{"session_id": "%s", "sampling_session_seq_id": 0, '
                  b'"base_model": "%s"}' % (session_id.encode(), local_cluster.base_models[0].encode()))
    assert opened.status_code == 200, opened.text
    body = (b'{"sampling_session_id": "%s", "seq_id": 0, "prompt": {"chunks": [1]}, "sampling_params": '
            b'{"max_tokens": 1}}' % opened.json()["sampling_session_id"].encode())
    assert_refused(post(local_cluster, "asample", body), 422, "prompt.chunks must be a list of chunk objects")


JSON_POST_ROUTES = sorted(path for path, methods in ingress_api.openapi()["paths"].items()
                          if "post" in methods and path != "/api/v1/forward_backward")


@pytest.mark.parametrize("path", JSON_POST_ROUTES)
def test_every_json_route_answers_a_body_of_another_type_with_a_415(local_cluster, path):
    url = local_cluster.api_url + path.replace("{session_id}", "s")
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/x-protobuf"):
        response = httpx.post(url, content=b"{}", headers={**API_KEY, "Content-Type": content_type}, timeout=30)
        assert_refused(response, 415, f"takes an application/json body, not {content_type}")


def test_forward_backward_without_a_content_type_is_a_415(local_cluster):
    body = pb.ForwardBackwardRequest(model_id="m", seq_id=1).SerializeToString()
    response = httpx.post(f"{local_cluster.api_url}/api/v1/forward_backward", content=body, headers=API_KEY)
    assert_refused(response, 415, "forward_backward takes a application/x-protobuf body")


def test_a_declared_size_over_the_limit_is_refused_before_the_body_is_sent(local_cluster):
    # Only the headers go out: the 413 comes from Content-Length alone, without waiting for the 64 MiB.
    head = (f"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: tml-local-test\r\n"
            f"Content-Type: application/json\r\nContent-Length: {(64 << 20) + 1}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", local_cluster.http_port), timeout=30) as connection:
        connection.sendall(head)
        answer = ""
        while not answer.endswith("}"):  # the JSON error body ends the answer
            chunk = connection.recv(65536).decode()
            if not chunk:
                break
            answer += chunk
    assert answer.startswith("HTTP/1.1 413") and "LILO_MAX_BODY_MB" in answer, answer


def forward_backward_body(model_id: str, loss_fn: str = "cross_entropy", weights=None, data: bool = True,
                          seq_id: int = 1) -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tokens = list(range(1, 10))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * 8})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum] if data else [], loss_fn=loss_fn),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_malformed_training_batch_is_a_422_at_once_and_the_next_seq_still_runs(local_cluster, session_id):
    created = post(local_cluster, "create_model", b'{"session_id": "%s", "model_seq_id": 1, "base_model": "%s", '
                   b'"lora_config": {"rank": 4}}' % (session_id.encode(), local_cluster.base_models[0].encode()))
    assert created.status_code == 200, created.text
    model_id = created.json()["model_id"]
    refusals = ((dict(loss_fn="hinge"), "Unknown loss_fn 'hinge'"),
                (dict(weights=[1.0] * 7), "has 7 entries but the input has 8"),
                (dict(weights=[float("nan")] * 8), "NaN or infinite"),
                (dict(data=False), "no data"))
    # Each refusal spends its seq_id, as the SDK's calls do: the well-formed request after them, under seq 5, runs
    # at once instead of waiting for seqs 1-4 forever.
    for seq_id, (fields, words) in enumerate(refusals, start=1):
        body = forward_backward_body(model_id, seq_id=seq_id, **fields)
        assert_refused(post(local_cluster, "forward_backward", body, PROTOBUF), 422, words)
    accepted = post(local_cluster, "forward_backward", forward_backward_body(model_id, seq_id=5), PROTOBUF)
    assert accepted.status_code == 200, accepted.text
    with httpx.Client(headers=JSON, timeout=60) as http:
        result = retrieve_finished(http, f"{local_cluster.api_url}/api/v1/retrieve_future",
                                   accepted.json()["request_id"], polls=2)
    assert "protobuf" in result.headers["content-type"], result.text
    # A refused seq is spent: sending a step under it again is a conflict that says to use the next seq_id.
    again = post(local_cluster, "forward_backward", forward_backward_body(model_id, seq_id=1), PROTOBUF)
    unload_models(local_cluster.api_url, [model_id])
    assert_refused(again, 409, "send each new step with the next seq_id")
