"""Every error as RFC 9457 ``application/problem+json``: type, title, status, detail."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.storage import TooLarge
from remat.errors import RematError

log = logging.getLogger("remat.api")
MEDIA_TYPE = "application/problem+json"


class ApiError(Exception):
    """An error the API reports on purpose."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.extra = extra


def problem(status: int, detail: str, request: Request | None = None, **extra: Any) -> JSONResponse:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
    }
    if request is not None:
        body["instance"] = request.url.path
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return problem(exc.status, exc.detail, request, **exc.extra)

    @app.exception_handler(RematError)
    async def _remat(request: Request, exc: RematError) -> JSONResponse:
        return problem(422, str(exc), request)

    @app.exception_handler(TooLarge)
    async def _too_large(request: Request, exc: TooLarge) -> JSONResponse:
        return problem(413, str(exc), request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return problem(422, detail or "invalid request", request, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        response = problem(exc.status_code, detail, request)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem(500, f"internal error: {type(exc).__name__}", request)
