"""Short-lived tokens (JWTs, HS256) that stand for an API key: the tinker SDK exchanges its key for one
(``POST /api/v1/auth/token``, with client/config's ``pjwt_auth_enabled``) and sends it instead of the key, renewing
it at half its life; ``whoami`` reads the caller's identity from its claims.

A token names its tenant (``org_id``, and ``sub`` ``tml:user:<tenant>``) and when it expires; it is signed with a key
derived from the cluster's secret (the one that signs download links, ``lilo.signed_urls``), so every ingress replica
checks it with no lookup, and a restart with the same home keeps it valid. Tokens cannot be revoked before they
expire (an hour): removing an API key stops new exchanges, not tokens already handed out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

from lilo.api_keys import Unauthorized

ISSUER = "lilo"
LIFETIME_S = 3600
# Tokens whose signature and claims were checked, kept so that a client's every request is not an HMAC and a JSON
# decode (a few % of the ingress's CPU); forgotten all at once when this many are held.
MAX_VERIFIED = 4096
_HEADER = {"alg": "HS256", "typ": "JWT"}


class InvalidToken(Unauthorized):
    """A token that is malformed, not signed by this cluster, or expired: the SDK exchanges its key again."""


def looks_like_token(credential: str) -> bool:
    """A JWT (three base64url parts, the first a JSON object), not an API key."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class SessionTokens:
    def __init__(self, secret: bytes) -> None:
        # Its own key, derived from the cluster's secret: a token's signature is never a download link's.
        self._key = hmac.new(secret, b"lilo session tokens", hashlib.sha256).digest()
        self._verified: dict[str, tuple[str, float]] = {}  # token -> (its tenant, when it expires)

    def mint(self, tenant: str, now: float, lifetime_s: float = LIFETIME_S) -> str:
        claims = {"iss": ISSUER, "sub": f"tml:user:{tenant}", "org_id": tenant, "email": "", "iat": int(now),
                  "exp": int(now + lifetime_s)}
        signed = f"{_encode(_HEADER)}.{_encode(claims)}"
        return f"{signed}.{self._signature(signed)}"

    def tenant_for(self, token: str, now: float) -> str:
        """The tenant ``token`` stands for; InvalidToken, saying why, when it is not a live token of this cluster."""
        verified = self._verified.get(token)
        if verified is None:
            verified = self._verify(token)
            if len(self._verified) >= MAX_VERIFIED:
                self._verified.clear()
            self._verified[token] = verified
        tenant, expires_at = verified
        if expires_at <= now:
            raise InvalidToken("This token has expired; the SDK exchanges its API key for a new one.")
        return tenant

    def _verify(self, token: str) -> tuple[str, float]:
        """The tenant and expiry a token of this cluster names; InvalidToken for any other."""
        signed, _, offered = token.rpartition(".")
        if not offered.isascii() or not hmac.compare_digest(self._signature(signed), offered):
            raise InvalidToken("This token was not issued by this server; send an API key (TINKER_API_KEY), which "
                               "the SDK exchanges for a token itself.")
        try:
            claims = json.loads(_decode(signed.split(".")[1]))
            tenant, expires_at = claims["org_id"], float(claims["exp"])
        except (ValueError, KeyError, TypeError, IndexError):
            raise InvalidToken("This token is malformed; send an API key (TINKER_API_KEY).") from None
        return tenant, expires_at

    def _signature(self, signed: str) -> str:
        return _b64(hmac.new(self._key, signed.encode(), hashlib.sha256).digest())


def _encode(value: dict) -> str:
    return _b64(json.dumps(value, separators=(",", ":"), sort_keys=True).encode())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
