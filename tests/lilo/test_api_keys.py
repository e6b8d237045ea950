"""API keys: where they come from and which tenant each is (the gate that answers 401:
tests/serve/test_api_key_gate.py)."""

import pytest

from lilo.api_keys import ApiKeyConfigError, ApiKeys, digest, load_key_digests
from lilo.settings import SettingsError, load_settings


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
