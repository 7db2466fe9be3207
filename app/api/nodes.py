"""``/v1/nodes`` and ``/v1/profiles``: the agents' nodes (online from heartbeats), their
devices and the cost tables they measured."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from sqlalchemy import select

from app.api.deps import Cursor, PathId, QueryId, ServicesDep, SessionDep, get_or_404, require_key
from app.pagination import MAX_LIMIT, fetch
from app.profiles import node_devices
from app.schemas import DeviceSpec, NodeOut, Page, ProfileOut
from app.tables import NodeRow, ProfileRow, now, utc

router = APIRouter(tags=["nodes"], dependencies=[Depends(require_key)])


def node_out(row: NodeRow, offline_after_s: float) -> NodeOut:
    """Not the row's columns as they are: whether the node is online comes from its last
    heartbeat and the server's setting, its devices from the stored document."""
    fresh = row.last_seen_at is not None and now() - utc(row.last_seen_at) < timedelta(
        seconds=offline_after_s
    )
    return NodeOut(
        id=row.id,
        name=row.name,
        status="online" if fresh else "offline",
        devices=[DeviceSpec.model_validate(d.model_dump()) for d in node_devices(row)],
        version=row.version,
        last_seen_at=row.last_seen_at,
        created_at=row.created_at,
    )


def profile_out(row: ProfileRow, with_table: bool = False) -> ProfileOut:
    """The profile; its cost table only when asked for (``GET /v1/profiles/{id}``)."""
    out = ProfileOut.model_validate(row, from_attributes=True)
    return out if with_table else out.model_copy(update={"table": None})


@router.get("/v1/nodes", response_model=Page[NodeOut])
def list_nodes(
    ctx: ServicesDep,
    session: SessionDep,
    cursor: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> Page[NodeOut]:
    rows, after = fetch(session, select(NodeRow), NodeRow, cursor, limit)
    offline = ctx.settings.offline_after_s
    return Page[NodeOut](items=[node_out(r, offline) for r in rows], next_cursor=after)


@router.get("/v1/nodes/{node_id}", response_model=NodeOut)
def get_node(node_id: PathId, ctx: ServicesDep, session: SessionDep) -> NodeOut:
    row = get_or_404(session, NodeRow, node_id, "node")
    return node_out(row, ctx.settings.offline_after_s)


@router.get("/v1/profiles", response_model=Page[ProfileOut])
def list_profiles(
    session: SessionDep,
    node_id: QueryId = None,
    model_id: QueryId = None,
    cursor: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> Page[ProfileOut]:
    query = select(ProfileRow)
    if node_id is not None:
        query = query.where(ProfileRow.node_id == node_id)
    if model_id is not None:
        query = query.where(ProfileRow.model_id == model_id)
    rows, after = fetch(session, query, ProfileRow, cursor, limit)
    return Page[ProfileOut](items=[profile_out(r) for r in rows], next_cursor=after)


@router.get("/v1/profiles/{profile_id}", response_model=ProfileOut)
def get_profile(profile_id: PathId, session: SessionDep) -> ProfileOut:
    row = get_or_404(session, ProfileRow, profile_id, "profile")
    return profile_out(row, with_table=True)
