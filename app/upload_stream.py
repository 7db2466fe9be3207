"""A ``multipart/form-data`` upload streamed into the model store as it arrives.

The body is read chunk by chunk (``Content-Length`` or chunked alike), counted against the
limit before anything is kept, and the ``file`` field's bytes go straight into a part file
of the store (``app.storage.Staging``); nothing is spooled elsewhere. python-multipart's
push parser splits the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from app.problem_details import ApiError
from app.storage import Staged, Staging, TooLarge

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

FILE_FIELD = "file"
FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers around the file
MAX_PARTS = 4


@dataclass(frozen=True)
class Uploaded:
    staged: Staged
    filename: str


async def receive_file(request: Request, staging: Staging) -> Uploaded:
    """Stream the request's ``file`` field into ``staging`` and finish it. ``TooLarge``
    as soon as the body passes the limit; ``ApiError`` for a body that is not such a
    form. ``staging`` is aborted on any failure (a client gone mid-upload included)."""
    try:
        boundary = _boundary(request.headers.get("content-type", ""))
        limit = staging.limit + FORM_OVERHEAD
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise TooLarge(staging.limit)
        form = _FormReader(staging)
        parser = MultipartParser(boundary, form.callbacks())
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise TooLarge(staging.limit)
            parser.write(chunk)
        parser.finalize()
        if form.filename is None:
            raise ApiError(422, f"the form has no file field named {FILE_FIELD!r}")
        if not form.complete:
            raise ApiError(422, "the multipart body ends before its last boundary")
        return Uploaded(staging.finish(), form.filename)
    except BaseException:
        staging.abort()
        raise


def _boundary(content_type: str) -> bytes:
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        shown = content_type if len(content_type) <= 100 else content_type[:97] + "..."
        raise ApiError(
            415,
            f"expected multipart/form-data with the ONNX file in {FILE_FIELD!r}, got {shown!r}",
        )
    return boundary


class _FormReader:
    """The parser's callbacks: which part is which, and the file part's bytes."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.filename: str | None = None
        self.complete = False
        self.parts = 0
        self._field = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}
        self._in_file = False

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise ApiError(422, f"the form has more than {MAX_PARTS} fields")
        self._headers, self._in_file = {}, False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        if params.get(b"name") != FILE_FIELD.encode():
            return
        if self.filename is not None:
            raise ApiError(422, f"the form has more than one {FILE_FIELD!r} field")
        self._in_file = True
        self.filename = params.get(b"filename", b"model.onnx").decode("utf-8", "replace")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.staging.write(data[start:end])

    def _end(self) -> None:
        self.complete = True
