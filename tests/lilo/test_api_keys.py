"""API keys: where they come from, which tenant each is, and the gate that answers 401 (local mode and keyed mode,
through the real middleware on a real FastAPI app, without a cluster)."""

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from lilo.api_keys import ApiKeyConfigError, ApiKeys, digest, load_key_digests
from lilo.settings import SettingsError, load_settings
from lilo.tenants import LOCAL_TENANT
from serve.auth import ApiKeyGate, caller


def test_keys_come_from_the_environment_and_a_file_each_naming_its_tenant(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators' keys\n\ntml-file-one=alpha   # a comment\ntml-file-two = beta\n")
    digests = load_key_digests(" tml-env-one=alpha , tml-env-bare ,", keys_file)
    keys = ApiKeys(digests)
    assert not keys.local
    assert [keys.tenant_for(key) for key in ("tml-env-one", "tml-file-one", "tml-file-two")] == [
        "alpha", "alpha", "beta"]
    # A bare key is a tenant of its own, named after its digest: the key itself is stored nowhere.
    assert keys.tenant_for("tml-env-bare") == f"key-{digest('tml-env-bare')[:12]}"
    assert "tml-env-bare" not in repr(digests) and "tml-file-one" not in repr(digests)


@pytest.mark.parametrize(("env", "message"), [
    ("sk-not-tinker=alpha", "keys start with 'tml-'"),
    ("tml-okay=../escape", "is not a name"),
    ("tml-okay=", "is not a name"),
    ("tml-two words", "malformed"),
    ("tml-same=alpha,tml-same=beta", "two tenants"),
])
def test_malformed_key_entries_are_refused_with_what_to_fix(env, message):
    with pytest.raises(ApiKeyConfigError, match=message):
        load_key_digests(env, None)


def test_settings_read_keys_from_the_environment_or_the_flag_and_say_what_is_wrong(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("tml-from-file=gamma\n")
    settings = load_settings(env={"LILO_API_KEYS": "tml-from-env=delta"}, api_keys_file=str(keys_file))
    assert not settings.local_mode
    assert sorted(settings.api_key_digests().values()) == ["delta", "gamma"]
    assert "tml-from-env" not in repr(settings)  # the settings are logged now and then; the keys are not
    assert load_settings(env={"LILO_API_KEYS_FILE": str(keys_file)}).api_keys_file == keys_file
    assert load_settings(env={}).local_mode
    with pytest.raises(SettingsError, match="Cannot read the API keys file"):
        load_settings(env={}, api_keys_file=str(tmp_path / "missing")).api_key_digests()


def test_only_loopback_is_served_without_keys(tmp_path):
    with pytest.raises(SettingsError, match="listens on loopback only, not 0.0.0.0"):
        load_settings(env={}, http_host="0.0.0.0")
    assert load_settings(env={"LILO_API_KEYS": "tml-a-real-key=alpha"}, http_host="0.0.0.0").http_host == "0.0.0.0"


@pytest.fixture
def gated(monkeypatch):
    """A FastAPI app behind the gate, answering the caller's tenant; ``gated(keys)`` sets the keys."""
    app = FastAPI()
    app.add_middleware(ApiKeyGate)

    @app.post("/api/v1/whoami")
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

