"""Which routes of the Tinker API need an API key: every one under /api/v1 but what a health check, or the SDK
before it authenticates, asks, and the signed download links (/docs and /openapi.json lie outside /api/v1 and are
open too: the schema is no secret)."""

from __future__ import annotations

from serve.http.auth import KeyedRoutes

TINKER_ROUTES = KeyedRoutes(
    "/api/v1/",
    open_paths=frozenset({"/api/v1/healthz", "/api/v1/client/config", "/api/v1/get_server_capabilities"}),
    # Signed download links (lilo.signed_urls): fetched without a key (urllib sends none); the route checks the
    # signature.
    open_prefixes=("/api/v1/downloads/",),
)
