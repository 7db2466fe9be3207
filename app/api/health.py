"""``/healthz`` (the process answers) and ``/readyz`` (database and job queue reachable)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from sqlalchemy import text

from app.context import Services, services
from app.problems import ApiError

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: Annotated[Services, Depends(services)]) -> dict[str, str]:
    try:
        with ctx.db.session() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:
        raise ApiError(503, f"database unreachable: {exc}") from exc
    try:
        ctx.dispatcher.check()
    except Exception as exc:
        raise ApiError(503, f"job queue unreachable: {exc}") from exc
    return {"status": "ready"}
