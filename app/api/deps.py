"""The routers' dependencies: the application's ``Services``, the request's database
session, the API-key check, and ids in paths and queries.

A request has one session (``SessionDep``), shared by every dependency and the handler
that ask for it: committed when the handler returns, rolled back when it raises, and
closed before the response is sent (the dependency's scope is the handler's call, not
the response's), so that a streamed response (``/v1/jobs/{id}/events``) holds no
connection for its life. A service that must commit before it acts outside the
database (``enqueue`` after the job row is committed) commits itself. Handlers that
wait (an agent's long poll, an upload's body, an event stream) take no session: the
authentication dependencies end their read at once, and what the handler reads while it
waits goes through ``Database.session()`` one short transaction at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from app.problem_details import ApiError
from app.schemas import ID_MAX, ID_PATTERN
from app.services import Services, get_or_404, key_digest
from app.tables import ApiKeyRow

API_KEY_HEADER = "X-API-Key"
# An id in a path or a query: malformed ones (a NUL byte, too long) get 422 before any
# database sees them.
PathId = Annotated[str, Path(pattern=ID_PATTERN, max_length=ID_MAX)]
QueryId = Annotated[str | None, Query(pattern=ID_PATTERN, max_length=ID_MAX)]
Cursor = Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_=-]+$", max_length=512)]

__all__ = ["get_or_404"]  # routers take it from here with the other dependencies


def services(request: Request) -> Services:
    """The application's ``Services`` (``app.main.create_app`` makes them)."""
    shared: Services = request.app.state.services
    return shared


def request_session(request: Request) -> Iterator[Session]:
    """The request's session: committed on success, rolled back on error."""
    with services(request).db.sessions() as session:
        try:
            yield session
        except BaseException:
            session.rollback()
            raise
        session.commit()


ServicesDep = Annotated[Services, Depends(services)]
SessionDep = Annotated[Session, Depends(request_session, scope="function")]


def require_key(request: Request, session: SessionDep) -> None:
    """Once any API key exists, model and job endpoints need one (``X-API-Key``)."""
    key = request.headers.get(API_KEY_HEADER)
    digest = key_digest(key) if key else ""
    # one round trip: whether any key exists, and whether this one does
    query = select(func.count(ApiKeyRow.id), func.max(case((ApiKeyRow.sha256 == digest, 1))))
    keys, found = session.execute(query).one()
    session.commit()  # the read ends here: a handler that waits holds no connection
    if keys and not found:
        raise ApiError(401, f"a valid API key is required in the {API_KEY_HEADER} header")
