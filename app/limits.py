"""Request limits applied before any handler runs (an ASGI middleware): a body larger than
its limit is answered 413, a body that stalls 408 (and its connection closed), and a URL
with a NUL character 422 (no database takes one in a string)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.problem_details import problem
from remat.devices import format_bytes

CLOSE = {"Connection": "close"}


class RequestLimits:
    """A request body may have ``max_body_bytes`` at most, or ``upload_bytes`` on the
    ``upload_paths`` (model uploads, which their handler bounds more closely). A declared
    ``Content-Length`` above the limit is refused before the body is read; a body that
    turns out larger stops the handler reading it. Each ``receive()`` of the body may wait
    ``body_timeout_s`` at most: a client that sends the headers and part of a body, then
    nothing, gets 408 instead of holding a connection and a worker thread forever. Once
    the body is complete ``receive()`` is left as it is (streaming responses wait on it
    for the client to disconnect). Both errors are raised into the handler reading the
    body, which answers them as problem+json, and close the connection."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        upload_bytes: int,
        upload_paths: Collection[str],
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.upload_bytes = upload_bytes
        self.upload_paths = frozenset(upload_paths)
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "\x00" in scope["path"] or b"%00" in scope["query_string"].lower():
            response = problem(422, "the URL contains a NUL character", headers=CLOSE)
            await response(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") in self.upload_paths
        limit = self.upload_bytes if upload else self.max_body_bytes
        too_large = f"the request body is larger than {format_bytes(limit)}, the limit here"
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await problem(413, too_large, headers=CLOSE)(scope, receive, send)
            return
        received = 0
        body_done = False

        async def receive_in_limits() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self.body_timeout_s):  # no task: nothing is lost
                    message = await receive()
            except TimeoutError:
                stalled = f"the request body stalled: nothing arrived for {self.body_timeout_s:g} s"
                raise HTTPException(408, stalled, headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large, headers=CLOSE)
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_limits, send)
