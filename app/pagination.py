"""Cursor pagination over (created_at, id), newest first: stable while rows are added."""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from app.problem_details import ApiError
from app.schemas import ID_MAX, ID_PATTERN

MAX_LIMIT = 200
_ID = re.compile(ID_PATTERN)


def encode(created_at: datetime, id_: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{id_}".encode()).decode()


def _decode(cursor: str) -> tuple[datetime, str]:
    """The cursor's time and id; 422 for anything ``encode`` did not make (the id checked
    as an id, so that no NUL byte or long text reaches the database)."""
    try:
        stamp, id_ = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        if len(id_) > ID_MAX or not _ID.fullmatch(id_) or len(stamp) > 40:
            raise ValueError(id_)
        return datetime.fromisoformat(stamp), id_
    except (ValueError, UnicodeDecodeError):
        raise ApiError(
            422, "cursor: not a cursor of this listing; pass next_cursor from a page"
        ) from None


def fetch(
    session: Session, query: Select[Any], table: Any, cursor: str | None, limit: int
) -> tuple[list[Any], str | None]:
    """One page of ``query``'s rows, newest first, and the cursor of the next (or None)."""
    rows = list(session.scalars(page(query, table, cursor, limit)))
    return rows[:limit], next_cursor(rows, limit)


def page(query: Select[Any], table: Any, cursor: str | None, limit: int) -> Select[Any]:
    """``query`` ordered newest first, after ``cursor``, one row more than ``limit`` (to
    know whether there is a next page)."""
    if cursor:
        created_at, id_ = _decode(cursor)
        query = query.where(
            or_(
                table.created_at < created_at,
                and_(table.created_at == created_at, table.id < id_),
            )
        )
    return query.order_by(table.created_at.desc(), table.id.desc()).limit(limit + 1)


def next_cursor(rows: list[Any], limit: int) -> str | None:
    if len(rows) <= limit:
        return None
    last = rows[limit - 1]
    return encode(last.created_at, last.id)
