"""The layer store: each layer unpacked once under ``layers/<sha256 hex>``, within a budget.

A layer is unpacked into ``tmp/`` and renamed into place only when complete and
verified, so a crash never leaves a half layer where a mount could see it (the
``tmp/`` leftovers are removed at start). Sizes and last use are kept in
``meta/<hex>.json``; when the total passes the budget, the least recently used
layers that nothing protects are removed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..metrics import EVICTIONS
from .errors import ImageError
from .unpack import Unpacked

log = logging.getLogger(__name__)
# The bottom layer of every image mount: only directories a sandbox's runtime
# mounts over (a read-only rootfs cannot grow a mount point at start). The
# image's own entries win; overlayfs also wants two lowers when there is no upper.
MOUNTPOINTS = "_mountpoints"
DEFAULT_MOUNTPOINTS = ("proc", "sys", "dev", "tmp")


def hex_of(digest: str) -> str:
    return digest.split(":", 1)[1]


class LayerStore:
    def __init__(self, root: Path, budget: int,
                 mountpoints: tuple[str, ...] = DEFAULT_MOUNTPOINTS):
        self.root = root
        self.budget = budget
        self.mountpoints = mountpoints
        self.layers_dir = root / "layers"
        self.meta_dir = root / "meta"
        self.tmp_dir = root / "tmp"
        self._lock = threading.RLock()
        self._fetch_locks: dict[str, threading.Lock] = {}
        self._meta: dict[str, dict] = {}

    def open(self) -> None:
        """Create the directories, remove crash leftovers, load what is stored."""
        for d in (self.layers_dir, self.meta_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._make_mountpoints()
        os.chmod(self.root, 0o700)
        for leftover in self.tmp_dir.iterdir():
            log.info("layer store: removing unfinished unpack %s", leftover.name)
            _remove(leftover)
        for meta in self.meta_dir.glob("*.json"):
            try:
                self._meta[meta.stem] = json.loads(meta.read_text())
            except (OSError, ValueError):
                meta.unlink(missing_ok=True)
        for layer in self.layers_dir.iterdir():
            if layer.name != MOUNTPOINTS and layer.name not in self._meta:
                log.info("layer store: removing layer %s without metadata", layer.name)
                _remove(layer)
        for name in list(self._meta):
            if not (self.layers_dir / name).is_dir():
                self._drop_meta(name)

    def _make_mountpoints(self) -> None:
        base = self.layers_dir / MOUNTPOINTS
        for name in self.mountpoints:
            d = base / name.strip("/")
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o1777 if name == "tmp" else 0o755)
        os.chmod(base, 0o755)

    def path(self, hex_digest: str) -> Path:
        return self.layers_dir / hex_digest

    def has(self, hex_digest: str) -> bool:
        with self._lock:
            return hex_digest in self._meta

    def size(self, hex_digest: str) -> int:
        with self._lock:
            return int(self._meta.get(hex_digest, {}).get("size", 0))

    def total(self) -> int:
        with self._lock:
            return sum(int(m.get("size", 0)) for m in self._meta.values())

    def stored(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._meta.items()}

    def touch(self, hexes: Iterable[str]) -> None:
        now = time.time()
        with self._lock:
            for h in hexes:
                if h in self._meta:
                    self._meta[h]["used"] = now
                    self._write_meta(h)

    def fetch_lock(self, hex_digest: str) -> threading.Lock:
        with self._lock:
            return self._fetch_locks.setdefault(hex_digest, threading.Lock())

    def add(self, hex_digest: str, unpack: Callable[[Path], Unpacked], source: str) -> bool:
        """Unpack a layer unless stored; True when it was fetched now."""
        with self.fetch_lock(hex_digest):
            if self.has(hex_digest):
                return False
            tmp = Path(tempfile.mkdtemp(prefix=hex_digest[:12] + ".", dir=self.tmp_dir))
            try:
                done = unpack(tmp)
                meta = {"size": done.size, "used": time.time(), "diff_id": done.diff_id,
                        "source": source, "skipped": done.skipped}
                os.rename(tmp, self.path(hex_digest))
            except BaseException:
                _remove(tmp)
                raise
            with self._lock:
                self._meta[hex_digest] = meta
                self._write_meta(hex_digest)
            return True

    def evict(self, protected: set[str], before_remove: Callable[[str], None],
              need: int = 0) -> list[str]:
        """Remove least recently used unprotected layers until ``need`` more bytes fit."""
        removed = []
        with self._lock:
            total = self.total()
            candidates = sorted((m.get("used", 0), h) for h, m in self._meta.items()
                                if h not in protected)
            for _, h in candidates:
                if total + need <= self.budget:
                    break
                try:
                    before_remove(h)
                except ImageError as exc:
                    log.warning("layer %s not evicted: %s", h[:12], exc)
                    continue
                total -= int(self._meta[h].get("size", 0))
                self.remove(h)
                removed.append(h)
        for h in removed:
            log.info("layer store: evicted layer %s (LRU, over budget)", h[:12])
        EVICTIONS.labels("image_layer").inc(len(removed))
        return removed

    def remove(self, hex_digest: str) -> None:
        with self._lock:
            # Renamed away first: a crash mid-delete leaves tmp/ junk, not a half layer.
            path = self.path(hex_digest)
            if path.exists():
                doomed = self.tmp_dir / f"rm-{hex_digest[:12]}-{os.getpid()}-{time.time_ns()}"
                os.rename(path, doomed)
                self._drop_meta(hex_digest)
                _remove(doomed)
            else:
                self._drop_meta(hex_digest)

    def _write_meta(self, h: str) -> None:
        tmp = self.meta_dir / f".{h}.tmp"
        tmp.write_text(json.dumps(self._meta[h]))
        os.replace(tmp, self.meta_dir / f"{h}.json")

    def _drop_meta(self, h: str) -> None:
        self._meta.pop(h, None)
        (self.meta_dir / f"{h}.json").unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
