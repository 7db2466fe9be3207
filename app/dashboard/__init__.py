"""The web dashboard: plain static pages (no build step, nothing from a CDN) that the API
serves itself: ``/`` is the single page, ``/dashboard/...`` its scripts and styles. The
pages talk to the same ``/v1`` API as any client."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from app.problem_details import ApiError

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything the pages load comes from this server: a stray CDN link or inline script
# fails loudly in the browser (and in the browser tests) instead of working by accident.
CSP = (
    "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# Revalidate on every load (ETag / Last-Modified): an upgraded server never runs stale JS.
HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": CSP}

router = APIRouter(include_in_schema=False)


def _assets() -> dict[str, Path]:
    """The files the dashboard may serve, by URL path: fixed at start, so no request can
    name a path outside the static folder."""
    return {
        path.relative_to(STATIC).as_posix(): path
        for path in STATIC.rglob("*")
        if path.is_file() and path.suffix in MEDIA_TYPES
    }


ASSETS = _assets()


def _file(name: str) -> FileResponse:
    path = ASSETS.get(name)
    if path is None:
        raise ApiError(404, f"the dashboard has no file {name!r}")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
def index() -> FileResponse:
    return _file("index.html")


@router.api_route("/dashboard/{name:path}", methods=["GET", "HEAD"])
def asset(name: str) -> FileResponse:
    return _file(name)
