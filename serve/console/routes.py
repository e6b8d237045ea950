"""The console's page and its files, read from ``static/`` once at import: open routes (outside /api/v1, so the API
key gate lets them through); the page asks the API for its data with the key the user signs in with."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, Response

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PAGE = "console.html"
# Only these files are served, by name: nothing a path could reach outside the folder.
ASSETS = {path.name: (path.read_bytes(), MEDIA_TYPES[path.suffix]) for path in sorted(STATIC.iterdir())
          if path.suffix in MEDIA_TYPES}
# The page is the only document, and it never embeds: a browser keeps it out of frames and off other origins' scripts.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'"}

router = APIRouter(include_in_schema=False)


def asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(status_code=404, detail=f"The console has no file {name!r}; open /console.")
    content, media_type = ASSETS[name]
    return Response(content=content, media_type=media_type, headers=HEADERS)


@router.get("/console")
async def console_page() -> Response:
    return asset(PAGE)


@router.get("/console/{name}")
async def console_asset(name: str) -> Response:
    return asset(name)
