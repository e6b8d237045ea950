"""The Serve app answers the calls a Tinker client makes first, over real HTTP on the local cluster."""

import httpx
import tinker


def test_healthz_answers_ok(local_cluster):
    response = httpx.get(f"{local_cluster.api_url}/api/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_client_config_answers_sdk_defaults(local_cluster):
    response = httpx.post(f"{local_cluster.api_url}/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert response.status_code == 200
    assert response.json() == {}


def test_server_capabilities_list_configured_base_models_default_first(local_cluster):
    response = httpx.get(f"{local_cluster.api_url}/api/v1/get_server_capabilities")
    assert response.status_code == 200
    models = response.json()["supported_models"]
    assert [m["model_name"] for m in models] == list(local_cluster.base_models)
    assert all(m["trainable"] and m["sampleable"] and m["max_context_length"] > 0 for m in models)


def test_the_tinker_sdk_reads_capabilities(local_cluster):
    client = tinker.RestClient(base_url=local_cluster.api_url, api_key="tml-local-test")
    capabilities = client.get_server_capabilities().result(timeout=60)
    assert [m.model_name for m in capabilities.supported_models] == list(local_cluster.base_models)
