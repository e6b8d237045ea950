"""The Serve app answers the calls a Tinker client makes first, over real HTTP on the local cluster."""

import httpx
import pytest
import tinker

from helpers import API_KEY, AUTH
from serve.tinker.client_flags import client_config


def test_healthz_answers_ok(local_cluster):
    response = httpx.get(f"{local_cluster.api_url}/api/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.parametrize("host, setting, compressed", [
    ("10.1.2.3", "auto", True), ("2001:db8::7", "auto", True), ("127.0.0.1", "auto", False), ("::1", "auto", False),
    (None, "auto", False), ("127.0.0.1", "always", True), ("10.1.2.3", "never", False)])
def test_client_config_asks_for_zstd_bodies_from_clients_on_other_machines(host, setting, compressed):
    flags = client_config(host, setting)
    assert flags["proto_compress_fwdbwd"] is compressed
    assert flags["sample_use_retrieve_futures"] and flags["sample_join_sampling_session"] and flags["pjwt_auth_enabled"]


def test_server_capabilities_list_configured_base_models_default_first(local_cluster):
    response = httpx.get(f"{local_cluster.api_url}/api/v1/get_server_capabilities")
    assert response.status_code == 200
    models = response.json()["supported_models"]
    assert [m["model_name"] for m in models] == list(local_cluster.base_models)
    assert all(m["trainable"] and m["sampleable"] and m["max_context_length"] > 0 for m in models)


def test_the_tinker_sdk_reads_capabilities(local_cluster):
    client = tinker.RestClient(base_url=local_cluster.api_url, api_key=API_KEY)
    capabilities = client.get_server_capabilities().result(timeout=60)
    assert [m.model_name for m in capabilities.supported_models] == list(local_cluster.base_models)


def test_a_body_over_the_limit_is_a_413_with_a_message_whatever_the_route(local_cluster):
    import httpx

    too_big = b"x" * ((64 << 20) + 1)  # the session cluster runs with the default limit, 64 MB
    for route in ("create_session", "forward_backward"):
        declared = httpx.post(f"{local_cluster.api_url}/api/v1/{route}", content=too_big, timeout=120,
                              headers={"Content-Type": "application/x-protobuf", **AUTH})
        assert declared.status_code == 413 and "LILO_MAX_BODY_MB" in declared.json()["detail"]

    def chunks():  # no Content-Length: refused once the streamed body passes the limit
        for _ in range(65):
            yield b"x" * (1 << 20)

    streamed = httpx.post(f"{local_cluster.api_url}/api/v1/create_session", content=chunks(), headers=AUTH,
                          timeout=120)
    assert streamed.status_code == 413 and "LILO_MAX_BODY_MB" in streamed.json()["detail"]


def test_a_body_declared_as_anything_but_json_is_a_415_with_a_message(local_cluster):
    import httpx

    api = f"{local_cluster.api_url}/api/v1"
    refused = httpx.post(f"{api}/create_session", content=b"{}", headers={"Content-Type": "text/plain", **AUTH},
                         timeout=60)
    assert refused.status_code == 415 and "takes an application/json body, not text/plain" in refused.json()["detail"]
    accepted = httpx.post(f"{api}/create_session", content=b"{}",
                          headers={"Content-Type": "application/json; charset=utf-8", **AUTH}, timeout=60)
    assert accepted.status_code == 200 and accepted.json()["session_id"]
    # forward_backward checks its own format: JSON there is the 415.
    wrong = httpx.post(f"{api}/forward_backward", json={}, headers=AUTH, timeout=60)
    assert wrong.status_code == 415 and "application/x-protobuf" in wrong.json()["detail"]
