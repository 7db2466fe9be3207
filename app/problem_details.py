"""HTTP error responses: every error as RFC 9457 "problem details"
(``application/problem+json``): type, title, status, detail. (Not to be confused with
the optimisation ``Problem`` of ``remat.strategies``.)

A problem never echoes what the client sent at length: details and the places named in
validation errors are cut to a few dozen characters, and validation errors carry the
place, the rule and its type, never the input (pydantic's ``input`` and ``ctx``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.storage import TooLarge
from remat.errors import RematError

log = logging.getLogger("remat.api")
MEDIA_TYPE = "application/problem+json"
MAX_DETAIL = 2000  # characters of a problem's detail
MAX_PLACE = 64  # characters of one part of a validation error's place
MAX_MESSAGE = 300  # characters of one validation error's message
MAX_ERRORS = 20  # validation errors listed
SCHEMA_NAME = "Problem"  # the body's name in the OpenAPI document


class ProblemError(BaseModel):
    """One reason a request is malformed: where (``["body", "devices", 0, "options"]``),
    the rule it breaks, and pydantic's error type."""

    loc: list[str | int]
    msg: str
    type: str


class ProblemDetails(BaseModel):
    """An error (RFC 9457). ``errors``: on 422 for a malformed request, each reason."""

    model_config = ConfigDict(title=SCHEMA_NAME)  # its name in the OpenAPI document

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[ProblemError] | None = None


_DESCRIPTIONS = {
    400: "the body cannot be parsed",
    401: "no valid API key (`X-API-Key`)",
    404: "no such resource",
    408: "the request body stalled",
    409: "conflicts with the resource's state",
    413: "the request body is too large",
    415: "unsupported content type",
    422: "the request is malformed or cannot be satisfied",
    503: "a service it needs (the database, the job queue) is unreachable",
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` documenting ``statuses`` as problem+json bodies."""
    schema = {"$ref": f"#/components/schemas/{SCHEMA_NAME}"}
    return {
        status: {"description": _DESCRIPTIONS[status], "content": {MEDIA_TYPE: {"schema": schema}}}
        for status in statuses
    }


class ApiError(Exception):
    """An error the API reports on purpose."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.extra = extra


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(
    status: int,
    detail: str,
    request: Request | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": shorten(detail, MAX_DETAIL),
    }
    if request is not None:
        body["instance"] = shorten(request.url.path, MAX_PLACE * 4)
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


def validation_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """Place, rule and type of each error (the first ``MAX_ERRORS``), cut short; pydantic's
    ``input`` and ``ctx`` (the value sent) are left out."""
    return [
        {
            "loc": [p if isinstance(p, int) else shorten(str(p), MAX_PLACE) for p in e["loc"]],
            "msg": shorten(str(e.get("msg", "")), MAX_MESSAGE),
            "type": shorten(str(e.get("type", "")), MAX_PLACE),
        }
        for e in errors[:MAX_ERRORS]
    ]


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
        errors = validation_errors(list(exc.errors()))
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return problem(422, detail or "invalid request", request, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return problem(exc.status_code, detail, request, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem(500, f"internal error: {type(exc).__name__}", request)

    _document_problems(app)


def _document_problems(app: FastAPI) -> None:
    """Put ``ProblemDetails`` (which ``responses()`` refers to) into the OpenAPI
    components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schema = ProblemDetails.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(schema.pop("$defs", {}))
        schemas[SCHEMA_NAME] = schema
        return document

    app.openapi = openapi  # type: ignore[method-assign]
