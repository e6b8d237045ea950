"""The ``tinker auth`` commands against lilo, as a user runs them: login checks a pasted key (auth/apikey/me) and
stores it, status and whoami work from the stored key (the SDK exchanges it for a token, auth/token, and reads its
identity from it), logout forgets it; a token lilo did not issue is a 401 that makes the SDK exchange again, and no
route deletes an operator's key."""

import json

import httpx

from helpers import API_KEY, tinker_cli


def test_login_status_whoami_and_logout(local_cluster, tmp_path):
    login = tinker_cli(local_cluster, "auth", "login", api_key=None, home=tmp_path, stdin=f"{API_KEY}\n")
    assert login.returncode == 0, login.stdout + login.stderr
    assert "Logged in as local@lilo.invalid (local)" in login.stdout
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert API_KEY in json.dumps(stored)
    status = tinker_cli(local_cluster, "auth", "status", api_key=None, home=tmp_path)
    assert status.returncode == 0 and "Tinker accessible: yes" in status.stdout, status.stdout + status.stderr
    whoami = tinker_cli(local_cluster, "-f", "json", "auth", "whoami", api_key=None, home=tmp_path)
    assert whoami.returncode == 0, whoami.stdout + whoami.stderr
    assert json.loads(whoami.stdout) == {"user_urn": "tml:user:local", "org_urn": "tml:organization:local",
                                         "email": None}
    logout = tinker_cli(local_cluster, "auth", "logout", api_key=None, home=tmp_path)
    assert logout.returncode == 0 and "Removed credential" in logout.stdout, logout.stdout + logout.stderr
    assert tinker_cli(local_cluster, "auth", "status", api_key=None, home=tmp_path).returncode != 0


def test_a_token_lilo_did_not_issue_asks_the_sdk_to_exchange_again_and_keys_are_not_deleted(local_cluster):
    api = f"{local_cluster.api_url}/api/v1"
    token = httpx.post(f"{api}/auth/token", headers={"X-API-Key": API_KEY}, json={}).json()["jwt"]
    assert httpx.post(f"{api}/get_info", headers={"X-API-Key": token}, json={"model_id": "none"}).status_code == 404
    header, claims, _ = token.split(".")
    forged = httpx.post(f"{api}/get_info", headers={"X-API-Key": f"{header}.{claims}.forged"}, json={"model_id": "x"})
    assert forged.status_code == 401 and 'error="invalid_token"' in forged.headers["www-authenticate"]
    deleted = httpx.delete(f"{api}/auth/apikey/me", headers={"X-API-Key": API_KEY})
    assert deleted.status_code == 403 and "operator" in deleted.json()["detail"]
