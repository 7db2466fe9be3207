"""The model file store: ONNX bytes under the data directory, keyed by sha256.

Uploads are streamed to a temporary file beside the store (hashing and counting as they
go) and moved into place only once complete, so that a failed or oversized upload leaves
nothing behind and a stored file is never partial.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
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


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}.onnx"

    async def stage(self, chunks: AsyncIterator[bytes], limit: int) -> Staged:
        """Write ``chunks`` to a temporary file; ``TooLarge`` (and no file) past ``limit``."""
        digest = hashlib.sha256()
        size = 0
        handle, name = tempfile.mkstemp(dir=self.root, suffix=".part")
        try:
            with os.fdopen(handle, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge(limit)
                    digest.update(chunk)
                    out.write(chunk)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        return Staged(Path(name), digest.hexdigest(), size)

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
