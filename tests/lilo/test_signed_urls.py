"""Signed download links: only an unaltered link lilo signed, before it expires, downloads; the secret lives in the
lilo home, readable by its owner only."""

import dataclasses
import stat

from lilo.signed_urls import DownloadGrant, read_secret, refusal, secret_file, signature

SECRET = bytes(range(32))
GRANT = DownloadGrant("alpha", "tinker://run-a/external_weights/export", "adapter_model.safetensors", 2000)


def test_an_unaltered_link_downloads_until_it_expires():
    offered = signature(SECRET, GRANT)
    assert refusal(SECRET, GRANT, offered, now=1999.0) is None
    assert "expired" in refusal(SECRET, GRANT, offered, now=2000.0)


def test_a_forged_or_altered_link_is_refused():
    offered = signature(SECRET, GRANT)
    assert "not one lilo signed" in refusal(SECRET, GRANT, "0" * 64, now=0)
    assert "not one lilo signed" in refusal(bytes(32), GRANT, offered, now=0)  # another service's secret
    assert "not one lilo signed" in refusal(SECRET, GRANT, "é" * 64, now=0)  # found by the fuzz test: not a 500
    assert "not one lilo signed" in refusal(SECRET, dataclasses.replace(GRANT, tenant="\ud800"), offered, now=0)
    for change in ({"tenant": "beta"}, {"tinker_path": "tinker://run-b/external_weights/export"},
                   {"file": "../../futures.db"}, {"expires_at": 10**10}):
        altered = dataclasses.replace(GRANT, **change)
        assert "not one lilo signed" in refusal(SECRET, altered, offered, now=0), change


def test_the_secret_is_made_once_and_readable_by_its_owner_only(tmp_path):
    path = secret_file(tmp_path / "home")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_secret(path)
    assert len(secret) == 32 and secret_file(tmp_path / "home") == path and read_secret(path) == secret
