"""The uploaded build contexts: tar archives named by their files hash, received
through signed upload URLs (with a size cap) and pruned once no build used them
for a while."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import AsyncIterable
from pathlib import Path

from .errors import BuildError

HASH = re.compile(r"^[0-9a-f]{64}$")
UPLOAD_URL_TTL = 3600
FILES_KEEP_S = 7 * 24 * 3600


class ContextFiles:
    """The context archives in ``files_dir``, one file per hash."""

    def __init__(self, files_dir: Path, max_bytes: int):
        self.files_dir = files_dir
        self.files_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        # Signs upload URLs; of this process only (the URLs live an hour, the SDKs use
        # them at once), so a leaked URL or API key never outlives a restart.
        self._key = secrets.token_bytes(32)

    def path(self, files_hash: str) -> Path | None:
        """The archive of that hash, if it was uploaded."""
        if not HASH.match(files_hash or ""):
            return None
        path = self.files_dir / files_hash
        return path if path.is_file() else None

    def upload_token(self, template_id: str, files_hash: str, expires: int) -> str:
        raw = f"{template_id}:{files_hash}:{expires}".encode()
        return hmac.new(self._key, raw, hashlib.sha256).hexdigest()

    def check_upload(self, template_id: str, files_hash: str, expires: str,
                     signature: str) -> None:
        if not HASH.match(files_hash):
            raise BuildError("files hash must be 64 lowercase hex digits")
        try:
            when = int(expires)
        except ValueError:
            raise BuildError("invalid upload URL", 403) from None
        if when < time.time():
            raise BuildError("the upload URL has expired", 403)
        if not hmac.compare_digest(self.upload_token(template_id, files_hash, when), signature):
            raise BuildError("invalid upload URL signature", 403)

    async def receive(self, files_hash: str, body: AsyncIterable[bytes]) -> int:
        """Store an uploaded context archive under its hash (atomically); one larger
        than ``max_bytes`` is refused (413) and nothing of it kept."""
        tmp = self.files_dir / f".{files_hash}.{secrets.token_hex(4)}.tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise BuildError(self.too_large(), 413)
                    await asyncio.to_thread(f.write, chunk)
            os.replace(tmp, self.files_dir / files_hash)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def too_large(self) -> str:
        return (f"the build context archive exceeds {self.max_bytes} bytes "
                "(build_context_max_bytes)")

    def prune(self) -> None:
        """Context archives no build used for a while go (a COPY touches its archive)."""
        cutoff = time.time() - FILES_KEEP_S
        for path in self.files_dir.iterdir():
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
