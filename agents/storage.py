"""The node's storage for paging (plan version 3, PORT): which directory it is, and files
written through to the disk and read back from it.

The directory is ``remat-agent --storage DIR``, else ``$REMAT_STORAGE``, else
``~/.cache/remat/storage``. One that is named (by the option or the variable) must be a
directory this process can write; only the last, the built-in default, is created where
it is missing. Each execution that pages and each measurement of the storage link works
in a subdirectory of its own, made in it and removed with everything in it at the end.

A file is written with ``write_through``: written, fsync'd (the data is on the disk
before the memory it came from is released) and then dropped from the page cache
(``POSIX_FADV_DONTNEED``, where the platform has it), so that reading it back reads the
disk, as paging a tensor back in on a busy node does, rather than a copy still in memory.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from agents.errors import StorageError

STORAGE_ENV = "REMAT_STORAGE"


def builtin_storage() -> Path:
    """The storage directory where none is named: ``~/.cache/remat/storage``."""
    return Path.home() / ".cache" / "remat" / "storage"


def resolve_storage(given: str | Path | None = None) -> Path:
    """The storage directory: ``given``, else ``$REMAT_STORAGE``, else the built-in one
    (created if missing). ``StorageError`` (naming it) where it is missing, not a
    directory, or not writable."""
    named = given if given is not None else os.environ.get(STORAGE_ENV) or None
    if named is None:
        path = builtin_storage()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(
                f"cannot create the storage directory {path}: {describe(error)}"
            ) from None
        return usable_storage(path)
    return usable_storage(Path(named).expanduser())


def usable_storage(path: Path) -> Path:
    """``path``, a directory this process can create files in (tried, not just its mode:
    root passes every mode check, not a read-only filesystem); ``StorageError`` if not."""
    if not path.exists():
        raise StorageError(f"the storage directory {path} does not exist")
    if not path.is_dir():
        raise StorageError(f"the storage {path} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".remat-probe-", dir=path)
    except OSError as error:
        raise StorageError(
            f"the storage directory {path} is not writable: {describe(error)}"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


@contextmanager
def scratch_directory(storage: Path, prefix: str) -> Iterator[Path]:
    """A new subdirectory of ``storage``, removed with its files when the block ends,
    however it ends. ``StorageError`` where it cannot be made."""
    try:
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=storage))
    except OSError as error:
        raise StorageError(
            f"cannot make a directory in the storage {storage}: {describe(error)}"
        ) from None
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def write_through(path: Path, chunks: Sequence[memoryview]) -> None:
    """Write ``chunks`` one after another into a new file at ``path`` (owner-only), fsync
    it and drop it from the page cache; the ``OSError`` of a write that fails (ENOSPC,
    EFBIG, EIO) propagates."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in chunks:
            done = 0
            while done < len(chunk):
                done += os.write(fd, chunk[done:])
        os.fsync(fd)
        _drop_cached(fd)
    finally:
        os.close(fd)


def read_back(path: Path, chunks: Sequence[memoryview]) -> None:
    """Fill ``chunks`` one after another from the file at ``path``; ``OSError`` where it
    cannot be read or is shorter than they are."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for chunk in chunks:
            done = 0
            while done < len(chunk):
                count = os.readv(fd, [chunk[done:]])
                if count == 0:
                    raise OSError(errno.EIO, f"{path.name} is shorter than what was written")
                done += count
        _drop_cached(fd)
    finally:
        os.close(fd)


def _drop_cached(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def describe(error: OSError) -> str:
    """An OS error in a few words (``No space left on device``), without the file name."""
    return error.strerror or str(error) or type(error).__name__
