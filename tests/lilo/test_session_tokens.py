"""Tokens that stand for an API key (lilo.session_tokens): minted for a tenant, read back by the same cluster until
they expire, refused when forged, tampered with, expired or from another cluster; and the SDK reads its identity
from their claims as it does from Tinker's."""

import pytest

from lilo.session_tokens import InvalidToken, SessionTokens, looks_like_token

SECRET = bytes(range(32))


def test_a_token_names_its_tenant_until_it_expires():
    tokens = SessionTokens(SECRET)
    token = tokens.mint("acme", now=1000.0, lifetime_s=60)
    assert looks_like_token(token) and not looks_like_token("tml-local")
    assert tokens.tenant_for(token, now=1059.0) == "acme"
    with pytest.raises(InvalidToken, match="expired"):
        tokens.tenant_for(token, now=1060.0)


def test_a_forged_tampered_or_foreign_token_is_refused():
    tokens = SessionTokens(SECRET)
    token = tokens.mint("acme", now=1000.0)
    assert tokens.tenant_for(token, now=1000.0) == "acme"  # the genuine one, checked once and remembered
    header, claims, signature = token.split(".")
    forged = SessionTokens(SECRET).mint("globex", now=1000.0).split(".")[1]
    for bad in (f"{header}.{forged}.{signature}", f"{header}.{claims}.{signature[:-2]}xx", "eyJ.x.y"):
        for checker in (tokens, SessionTokens(SECRET)):
            with pytest.raises(InvalidToken, match="not issued by this server"):
                checker.tenant_for(bad, now=1000.0)
    with pytest.raises(InvalidToken):
        SessionTokens(bytes(32)).tenant_for(token, now=1000.0)


def test_the_sdk_reads_whoami_from_the_claims():
    from tinker.lib.public_interfaces.rest_client import _whoami_response_from_jwt

    identity = _whoami_response_from_jwt(SessionTokens(SECRET).mint("acme", now=1000.0))
    assert (identity.user_urn, identity.org_urn, identity.email) == ("tml:user:acme", "tml:organization:acme", None)
