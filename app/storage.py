"""The model file store: ONNX bytes under the data directory, keyed by sha256.

Uploads are written to a temporary ``*.part`` file beside the store (hashing and counting
as the bytes arrive, refused past the size limit) and moved into place only once complete,
so that a failed or oversized upload leaves nothing behind and a stored file is never
partial. A writer holds an exclusive ``flock`` on its part file: a part file nobody holds
was left by a process that died mid-upload, and is removed when a store opens (several
API processes may share the directory; a lock tells whose upload is still going).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the upload exceeds the limit of {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class Staged:
    """An upload written to a temporary file, not yet in the store."""

    path: Path
    sha256: str
    size: int


class Staging:
    """An upload being written: ``write`` as bytes arrive, then ``finish`` or ``abort``."""

    def __init__(self, root: Path, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._digest = hashlib.sha256()
        handle, name = tempfile.mkstemp(dir=root, suffix=".part")
        self.path = Path(name)
        self._file = os.fdopen(handle, "wb")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)

    def write(self, chunk: bytes) -> None:
        """Append ``chunk``; ``TooLarge`` past the limit (the caller aborts)."""
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(self.limit)
        self._digest.update(chunk)
        self._file.write(chunk)

    def finish(self) -> Staged:
        self._file.close()  # releases the lock: the caller keeps or discards it now
        return Staged(self.path, self._digest.hexdigest(), self.size)

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_abandoned_parts()

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}.onnx"

    def staging(self, limit: int) -> Staging:
        """A new upload's temporary file; ``TooLarge`` from its writes past ``limit``."""
        return Staging(self.root, limit)

    def remove_abandoned_parts(self) -> list[Path]:
        """Remove the part files no writer holds (their upload's process died)."""
        removed = []
        for part in self.root.glob("*.part"):
            with contextlib.suppress(FileNotFoundError), part.open("rb") as handle:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # an upload in progress
                part.unlink(missing_ok=True)
                removed.append(part)
        return removed

    def keep(self, staged: Staged) -> Path:
        """Move a staged upload into the store (the same bytes twice: one file)."""
        target = self.path(staged.sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.path, target)
        return target

    def discard(self, staged: Staged) -> None:
        staged.path.unlink(missing_ok=True)

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)
