"""``/healthz`` (the process answers) and ``/readyz`` (database and job queue reachable)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from app.api.deps import ServicesDep
from app.problem_details import ApiError

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: ServicesDep) -> dict[str, str]:
    # its own session, not the request's: an unreachable database is a 503 here, not an
    # error in the session dependency's commit
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
