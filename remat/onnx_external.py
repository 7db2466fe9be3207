"""Where a model's tensors may be read from: the rule for ONNX external data.

A tensor with ``data_location: EXTERNAL`` names a file (``location``) relative to the
model's directory. Read naively (``numpy_helper.to_array`` with no base directory) that
location is resolved against the process's working directory, so a crafted model can
make whoever ingests it read any file it can open. Remat therefore reads no external
data unless the caller names the directory the model's own files live in, and even then
only initializers whose location stays inside it.

A model and its data files may also come as a zip archive (``load_archive``): the data
is read from members of the archive only, never from the file system, and embedded into
the model, which comes out self-contained. That is how the service takes such models:
what it stores, and what workers and agents load, is always a single file, loaded with no
directory at all, so any external data left in it is refused. ``remat plan model.onnx``
passes the model's own directory; ``remat submit`` packs the model and its data files
into an archive (``archive_with_external_data``). Refusals name the tensor and the
location as written in the file, never whether a path outside an archive exists or what
it holds.
"""

from __future__ import annotations

import io
import lzma
import math
import os
import posixpath
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO

import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, TensorProto, helper

from remat.errors import ModelLoadError


def check_external_data(model: onnx.ModelProto, base_dir: Path | None) -> None:
    """Refuse external data that Remat may not read: any, where ``base_dir`` is None;
    otherwise any outside ``base_dir`` and any in a node attribute. Raises ModelLoadError."""
    for owner, tensor in _tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        if base_dir is None:
            raise ModelLoadError(
                f"{owner} keeps its data outside the model file (ONNX external data); "
                "upload a self-contained model (onnx.save(model, path, "
                "save_as_external_data=False)) or a zip archive of the model and its data files"
            )
        if not owner.startswith("initializer"):
            raise ModelLoadError(
                f"{owner} keeps its data outside the model file (ONNX external data); "
                "only initializers may"
            )
        _check_location(owner, _location(tensor), base_dir)


def _location(tensor: TensorProto) -> str:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    return entries.get("location", "")


def _is_plain_relative(location: str) -> bool:
    """Whether ``location`` is a non-empty relative path without a NUL, a drive or ``..``,
    read as a POSIX and as a Windows path."""
    if not location or "\0" in location:
        return False
    return not any(
        flavour.is_absolute() or flavour.drive or ".." in flavour.parts
        for flavour in (PurePosixPath(location), PureWindowsPath(location))
    )


def _check_location(owner: str, location: str, base_dir: Path) -> None:
    """``location`` must be a plain relative path that stays inside ``base_dir`` once
    symbolic links are followed."""
    refusal = ModelLoadError(
        f"{owner}: external data location {_shown(location)} is not a file inside the "
        "model's directory"
    )
    if not _is_plain_relative(location):
        raise refusal
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, target]) != root or target == root:
        raise refusal


# --- zip archives -------------------------------------------------------------------------

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a member's local header; an empty archive's end
MAX_ARCHIVE_BYTES = 2**31 - 1  # protobuf's limit on one serialized model
MAX_MEMBERS = 65_536
READ_CHUNK = 1 << 20
IGNORED_PREFIX = "__MACOSX/"  # resource forks macOS adds to the archives it makes
# What a broken archive makes zipfile and its decompressors raise.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    ValueError,
    NotImplementedError,
    RuntimeError,
    zlib.error,
    lzma.LZMAError,
    struct.error,
)


@dataclass(frozen=True)
class Archived:
    """The model of a zip archive, with the external data it names embedded."""

    model: onnx.ModelProto
    name: str  # the .onnx member's file name


def is_zip(head: bytes) -> bool:
    """Whether bytes starting with ``head`` (4 bytes suffice) are a zip archive. An ONNX
    file starts with 0x08 (its IR version's tag), so the two are never confused."""
    return head[:4] in ZIP_MAGIC


def starts_like_zip(path: Path) -> bool:
    """Whether the file at ``path`` is a zip archive, by its first bytes."""
    try:
        with path.open("rb") as handle:
            return is_zip(handle.read(4))
    except OSError:
        return False


def model_in_directory(directory: Path) -> Path:
    """The one ``.onnx`` file in ``directory``, where its external data files lie beside
    it; ModelLoadError if there is none, or several."""
    try:
        found = sorted(
            p for p in directory.iterdir() if p.suffix.lower() == ".onnx" and p.is_file()
        )
    except OSError as error:
        raise ModelLoadError(f"cannot read the directory {directory}: {error.strerror}") from None
    if not found:
        raise ModelLoadError(f"no .onnx file in {directory}")
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5]) + (", ..." if len(found) > 5 else "")
        raise ModelLoadError(
            f"{directory} holds {len(found)} .onnx files ({names}); name the one to use"
        )
    return found[0]


def load_archive(source: Path | BinaryIO, max_bytes: int = MAX_ARCHIVE_BYTES) -> Archived:
    """The one ``.onnx`` member of a zip archive, parsed, with the external data of its
    initializers read from the archive's members (locations relative to the ``.onnx``
    member's folder) and embedded, so that the model needs no other file. Nothing is
    read from or written to the file system but ``source`` itself.

    Refused with a one-line ModelLoadError: a corrupt archive; members that are encrypted,
    symbolic links or other non-regular files, named with an absolute path or ``..``, or
    named twice; no ``.onnx`` member, or several; external data outside initializers; a
    location that is malformed or names no member; an offset or length outside its
    member, or data whose size does not match the tensor's shape. Sizes are bounded by
    ``max_bytes``: the sizes the members declare (all of them together), the bytes
    actually decompressed (reading stops once past it), and the model with its data
    embedded."""
    try:
        with zipfile.ZipFile(source) as archive:
            return _unpack(archive, max_bytes)
    except ModelLoadError:
        raise
    except _ZIP_ERRORS as error:
        raise ModelLoadError(f"not a readable zip archive: {_gist(error)}") from None


def _unpack(archive: zipfile.ZipFile, max_bytes: int) -> Archived:
    members = archive.infolist()
    if len(members) > MAX_MEMBERS:
        raise ModelLoadError(f"the archive has {len(members)} members; at most {MAX_MEMBERS}")
    files: dict[str, zipfile.ZipInfo] = {}
    declared = 0
    for info in members:
        _check_member(info)
        if info.is_dir():
            continue
        if info.filename in files:
            raise ModelLoadError(f"member {_shown(info.filename)} appears twice in the archive")
        files[info.filename] = info
        declared += info.file_size
    if declared > max_bytes:
        raise ModelLoadError(
            f"the archive unpacks to {declared} bytes, more than the limit of {max_bytes}"
        )
    found = sorted(
        n for n in files if n.lower().endswith(".onnx") and not n.startswith(IGNORED_PREFIX)
    )
    if not found:
        raise ModelLoadError("the archive holds no .onnx file")
    if len(found) > 1:
        names = ", ".join(_shown(n) for n in found[:5]) + (", ..." if len(found) > 5 else "")
        raise ModelLoadError(
            f"the archive holds {len(found)} .onnx files ({names}); it must hold one"
        )
    name = found[0]
    unpacked = _Budget(max_bytes, "the archive unpacks to more than the limit of {} bytes")
    data = _read_member(archive, files[name], unpacked)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise ModelLoadError(f"{_shown(name)} is not an ONNX model: {_gist(error)}") from None
    embedded = _Budget(
        max_bytes, "the model with its external data embedded is larger than the limit of {} bytes"
    )
    embedded.take(len(data))
    del data
    _embed(model, archive, files, posixpath.dirname(name), unpacked, embedded)
    return Archived(model, posixpath.basename(name))


def _check_member(info: zipfile.ZipInfo) -> None:
    """Refuse members that are encrypted, not plain files or folders, or named with an
    absolute path or ``..``: none is ever written to disk, but none has a place in a model
    archive either."""
    name = info.filename
    for flavour in (PurePosixPath(name), PureWindowsPath(name)):
        if flavour.is_absolute() or flavour.drive or ".." in flavour.parts:
            raise ModelLoadError(
                f"member {_shown(name)} has an absolute path or '..'; "
                "the archive's names must be relative paths inside it"
            )
    if info.flag_bits & 0x1:
        raise ModelLoadError(f"member {_shown(name)} is encrypted; archives must not be")
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise ModelLoadError(
            f"member {_shown(name)} is a symbolic link; archives must not hold any"
        )
    if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ModelLoadError(f"member {_shown(name)} is not a regular file")


class _Budget:
    """Bytes counted against a limit; ModelLoadError (``message``) once past it."""

    def __init__(self, limit: int, message: str) -> None:
        self.limit = limit
        self.used = 0
        self.message = message

    def take(self, count: int) -> None:
        self.used += count
        if self.used > self.limit:
            raise ModelLoadError(self.message.format(self.limit))


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, budget: _Budget) -> bytes:
    """A member's bytes, counted as they are decompressed: reading stops past the budget
    whatever size the member declared."""
    out = bytearray()
    with archive.open(info) as stream:
        while chunk := stream.read(READ_CHUNK):
            budget.take(len(chunk))
            out += chunk
    return bytes(out)


def _embed(
    model: onnx.ModelProto,
    archive: zipfile.ZipFile,
    files: dict[str, zipfile.ZipInfo],
    folder: str,
    unpacked: _Budget,
    embedded: _Budget,
) -> None:
    """Replace each external initializer's reference by its bytes from the archive; each
    member is read once, however many tensors it holds."""
    by_member: dict[str, list[tuple[str, TensorProto]]] = {}
    for owner, tensor in _tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        if not owner.startswith("initializer"):
            raise ModelLoadError(
                f"{owner} keeps its data outside the model file (ONNX external data); "
                "only initializers may"
            )
        member = _member(owner, _location(tensor), folder, files)
        by_member.setdefault(member, []).append((owner, tensor))
    for member, tensors in by_member.items():
        data = _read_member(archive, files[member], unpacked)
        for owner, tensor in tensors:
            start, end = _extent(owner, tensor, len(data))
            _check_size(owner, tensor, end - start)
            embedded.take(end - start)
            tensor.raw_data = data[start:end]
            del tensor.external_data[:]
            tensor.ClearField("data_location")  # DEFAULT, serialized as an embedded one is


def _member(owner: str, location: str, folder: str, files: dict[str, zipfile.ZipInfo]) -> str:
    """The member a location names, relative to the ``.onnx`` member's folder."""
    refusal = ModelLoadError(
        f"{owner}: external data location {_shown(location)} is not a file in the archive"
    )
    if not _is_plain_relative(location):
        raise refusal
    name = posixpath.normpath(posixpath.join(folder, location))
    if name not in files:
        raise refusal
    return name


def _extent(owner: str, tensor: TensorProto, size: int) -> tuple[int, int]:
    """Where in its member a tensor's bytes lie: ``offset`` (default 0) and ``length``
    (default: to the member's end), both inside the member."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = _shown(entries.get("location", ""))
    numbers: dict[str, int] = {}
    for key in ("offset", "length"):
        text = entries.get(key)
        if text is None:
            continue
        if not (text.isascii() and text.isdigit()):
            raise ModelLoadError(f"{owner}: external data {key} {_shown(text)} is not a number")
        numbers[key] = int(text)
    start = numbers.get("offset", 0)
    end = start + numbers.get("length", max(size - start, 0))
    if start > size or end > size:
        raise ModelLoadError(
            f"{owner}: offset {start} and length {end - start} lie outside {location} "
            f"({size} bytes)"
        )
    return start, end


def _item_sizes() -> dict[int, int]:
    """Bytes per element of the fixed-size tensor types (not strings nor 4-bit types)."""
    sizes = {
        "FLOAT": 4, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "INT32": 4, "INT64": 8,
        "BOOL": 1, "FLOAT16": 2, "DOUBLE": 8, "UINT32": 4, "UINT64": 8, "COMPLEX64": 8,
        "COMPLEX128": 16, "BFLOAT16": 2, "FLOAT8E4M3FN": 1, "FLOAT8E4M3FNUZ": 1,
        "FLOAT8E5M2": 1, "FLOAT8E5M2FNUZ": 1,
    }  # fmt: skip
    return {getattr(TensorProto, k): v for k, v in sizes.items() if hasattr(TensorProto, k)}


_ITEM_SIZES = _item_sizes()


def _check_size(owner: str, tensor: TensorProto, nbytes: int) -> None:
    itemsize = _ITEM_SIZES.get(tensor.data_type)
    if itemsize is None:
        return
    needed = math.prod(tensor.dims) * itemsize
    if needed != nbytes:
        kind = helper.tensor_dtype_to_string(tensor.data_type).removeprefix("TensorProto.")
        raise ModelLoadError(
            f"{owner}: its shape {list(tensor.dims)} of {kind} needs {needed} bytes, "
            f"its external data holds {nbytes}"
        )


def archive_with_external_data(path: Path) -> bytes | None:
    """The model file at ``path`` and the data files its initializers name, as a zip
    archive built in memory (the model under its own name, each file under its location);
    None when the file has no external data, or is no ONNX model at all (it is then sent
    as it is and whoever loads it says what is wrong). The locations are checked as
    ``check_external_data`` checks them against the file's own directory."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return None
    external = [t for _, t in _tensors(model) if t.data_location == TensorProto.EXTERNAL]
    if not external:
        return None
    check_external_data(model, path.parent)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(path.name, data)
        for location in sorted({_location(t) for t in external}):
            try:
                content = (path.parent / location).read_bytes()
            except OSError as error:
                raise ModelLoadError(
                    f"cannot read external data {_shown(location)} beside {path.name}: "
                    f"{error.strerror}"
                ) from None
            archive.writestr(posixpath.normpath(location), content)
    return buffer.getvalue()


def _shown(text: str) -> str:
    """A name from a file, quoted and cut short."""
    return repr(text if len(text) <= 120 else text[:117] + "...")


def _gist(error: BaseException) -> str:
    line = next((x.strip() for x in str(error).splitlines() if x.strip()), type(error).__name__)
    return line if len(line) <= 200 else line[:197] + "..."


def _tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every tensor stored in the model, with a description of where it sits: the main
    graph's initializers and those of every subgraph and function, sparse tensors' values
    and indices, and tensors in node attributes (``Constant``'s ``value`` and the like)."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, TensorProto]]:
    for tensor in graph.initializer:
        yield f"initializer {tensor.name!r}", tensor
    for sparse in graph.sparse_initializer:
        yield f"initializer {sparse.values.name!r} (sparse values)", sparse.values
        yield f"initializer {sparse.values.name!r} (sparse indices)", sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, TensorProto]]:
    label = f"node {node.name or node.op_type!r} ({node.op_type})"
    for attr in node.attribute:
        where = f"attribute {attr.name!r} of {label}"
        if attr.type == AttributeProto.TENSOR:
            yield where, attr.t
        elif attr.type == AttributeProto.TENSORS:
            yield from ((where, t) for t in attr.tensors)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            yield from ((where, t) for t in (attr.sparse_tensor.values, attr.sparse_tensor.indices))
        elif attr.type == AttributeProto.SPARSE_TENSORS:
            for sparse in attr.sparse_tensors:
                yield from ((where, t) for t in (sparse.values, sparse.indices))
        elif attr.type == AttributeProto.GRAPH:
            yield from _graph_tensors(attr.g)
        elif attr.type == AttributeProto.GRAPHS:
            for graph in attr.graphs:
                yield from _graph_tensors(graph)
