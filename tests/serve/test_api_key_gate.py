"""The API-key gate that answers 401, in local mode and keyed mode, through the real middleware on a real FastAPI app,
without a cluster (where the keys come from: tests/lilo/test_api_keys.py)."""

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from lilo.api_keys import ApiKeys, load_key_digests
from lilo.tenants import LOCAL_TENANT
from serve.http.auth import ApiKeyGate, caller
from serve.openai.keys import OPENAI_ROUTES
from serve.tinker.keys import TINKER_ROUTES


@pytest.fixture
def gated(monkeypatch):
    """A FastAPI app behind the gate, answering the caller's tenant; ``gated(keys)`` sets the keys."""
    app = FastAPI()
    app.add_middleware(ApiKeyGate, routes=(TINKER_ROUTES, OPENAI_ROUTES))

    @app.post("/api/v1/whoami")
    @app.post("/oai/api/v1/whoami")
    def whoami(tenant: str = Depends(caller)) -> dict:
        return {"tenant": tenant}

    @app.get("/api/v1/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    def with_keys(keys: ApiKeys) -> TestClient:
        monkeypatch.setattr(ApiKeyGate, "keys", keys)
        return TestClient(app)

    return with_keys


def test_local_mode_takes_any_tml_key_as_the_local_tenant_and_refuses_the_rest(gated):
    client = gated(ApiKeys({}))
    for key in ("tml-local-test", "tml-local-demo", "tml-anything"):
        assert client.post("/api/v1/whoami", headers={"X-API-Key": key}).json() == {"tenant": LOCAL_TENANT}
    for headers, message in (({}, "has no API key; send one in the X-API-Key header"),
                             ({"X-API-Key": "sk-123"}, "API keys start with 'tml-'")):
        refused = client.post("/api/v1/whoami", headers=headers, json={"ignored": True})
        assert refused.status_code == 401, refused.text
        assert message in refused.json()["detail"] and "local mode" in refused.json()["detail"]
        assert refused.headers["www-authenticate"] == "X-API-Key"
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}  # open without a key


def test_with_keys_only_configured_keys_get_in_each_as_its_tenant(gated):
    client = gated(ApiKeys(load_key_digests("tml-alpha-key=alpha,tml-beta-key=beta", None)))
    assert client.post("/api/v1/whoami", headers={"X-API-Key": "tml-alpha-key"}).json() == {"tenant": "alpha"}
    assert client.post("/api/v1/whoami", headers={"X-API-Key": "tml-beta-key"}).json() == {"tenant": "beta"}
    unknown = client.post("/api/v1/whoami", headers={"X-API-Key": "tml-local-test"})
    assert unknown.status_code == 401 and "Unknown API key" in unknown.json()["detail"]
    assert "local mode" not in client.post("/api/v1/whoami").json()["detail"]



def test_the_openai_routes_take_a_bearer_key_and_refuse_in_openais_shape(gated):
    client = gated(ApiKeys(load_key_digests("tml-alpha-key=alpha", None)))
    for headers in ({"Authorization": "Bearer tml-alpha-key"}, {"X-API-Key": "tml-alpha-key"}):
        assert client.post("/oai/api/v1/whoami", headers=headers).json() == {"tenant": "alpha"}
    # The Tinker routes read X-API-Key only, as the tinker SDK sends it.
    assert client.post("/api/v1/whoami", headers={"Authorization": "Bearer tml-alpha-key"}).status_code == 401
    refused = client.post("/oai/api/v1/whoami", headers={"Authorization": "Bearer tml-wrong"})
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["code"] == "invalid_api_key" and "Unknown API key" in error["message"]
    assert "Authorization: Bearer" in error["message"]
