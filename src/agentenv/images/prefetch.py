"""Prefetch from the first run: the files a layer's first use read, in order, recorded
by its server beside the layer's index in the shared repository
(``image-prefetch/<layer hex>.json``); a later server of the layer, on any node, fetches
those files' chunks into the node's chunk cache in the background from its start, so
the reads of a task's first command find them there.

Recording: the first server of a layer with no list notes each file's first read for
``RECORD_S`` after the first read (a boot and a task's first command), at most
``MAX_FILES`` files, and writes the list when that time is over or when it is unmounted,
unless another node wrote one meanwhile. A list read from the repository is hostile
input: bounded in size and count, and names not in the layer's index are skipped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agentenv.snapshot.errors import ObjectMissing, SnapshotError
from agentenv.snapshot.image_objects import PREFETCH_PREFIX, prefetch_key

log = logging.getLogger("agentenv.lazyfs")
PREFIX = PREFETCH_PREFIX
RECORD_S = 30.0
MAX_FILES = 4096
MAX_LIST_BYTES = 1 << 20
MAX_PREFETCH_BYTES = 512 << 20  # chunks fetched ahead, at most


def key_of(layer_hex: str) -> str:
    return prefetch_key(layer_hex)


class Prefetch:
    """One layer server's recording (or prefetching): ``opened`` sees each read's path."""

    def __init__(self, layer_hex: str, repo_config: dict[str, Any], name: str,
                 known: Callable[[str], bool], fetch: Callable[[str], int]):
        self.key = key_of(layer_hex)
        self.repo_config = repo_config
        self.name = name
        self._known = known  # a path is a regular file of the layer
        self._fetch = fetch  # the file's chunks into the cache; bytes fetched
        self._repo: Any = None
        self._order: list[str] = []
        self._seen: set[str] = set()
        # Reads are noted from the start; a list found in the repository ends that.
        self._recording = True
        self._first: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._written = False

    def start(self) -> None:
        threading.Thread(target=self._run, name="prefetch", daemon=True).start()

    def _open(self) -> Any:
        if self._repo is None:
            from agentenv.snapshot.backends import open_repository
            self._repo = open_repository(self.repo_config)
        return self._repo

    def _run(self) -> None:
        try:
            try:
                raw = self._open().get_object(self.key)
            except ObjectMissing:
                self._record()
                return
            with self._lock:
                self._recording = False
            self._prefetch(raw)
        except Exception:  # prefetching is an optimisation: reads go on without it
            log.exception("lazyfs %s: prefetch failed", self.name)

    # -- recording -----------------------------------------------------------------

    def opened(self, path: str) -> None:
        with self._lock:
            if not self._recording or path in self._seen or len(self._order) >= MAX_FILES:
                return
            if self._first is None:
                self._first = time.monotonic()
            self._seen.add(path)
            self._order.append(path)

    def _record(self) -> None:
        while not self._done.wait(1.0):
            with self._lock:
                first = self._first
            if first is not None and time.monotonic() - first >= RECORD_S:
                break
        self.write()

    def write(self) -> None:
        """The list, once (at the end of the window, or at unmount: whichever first)."""
        with self._lock:
            if not self._recording or self._written or not self._order:
                return
            self._written, self._recording = True, False
            order = list(self._order)
        try:
            repo = self._open()
            try:
                repo.get_object(self.key)
                return  # another node's first run was recorded first
            except ObjectMissing:
                pass
            repo.put_object(self.key, json.dumps({"version": 1, "files": order}).encode())
            log.info("lazyfs %s: recorded the first run's %d files for prefetching",
                     self.name, len(order))
        except SnapshotError as exc:
            log.warning("lazyfs %s: prefetch list not written: %s", self.name, exc)

    def stop(self) -> None:
        self._done.set()
        self.write()

    # -- prefetching -----------------------------------------------------------------

    def _prefetch(self, raw: bytes) -> None:
        if len(raw) > MAX_LIST_BYTES:
            log.warning("lazyfs %s: prefetch list of %d bytes ignored", self.name, len(raw))
            return
        try:
            doc = json.loads(raw)
            files = doc["files"] if isinstance(doc, dict) and doc.get("version") == 1 else None
        except (ValueError, KeyError):
            files = None
        if not isinstance(files, list):
            log.warning("lazyfs %s: malformed prefetch list ignored", self.name)
            return
        t0 = time.perf_counter()
        fetched = count = 0
        for path in files[:MAX_FILES]:
            if self._done.is_set() or fetched >= MAX_PREFETCH_BYTES:
                break
            if isinstance(path, str) and self._known(path):
                try:
                    fetched += self._fetch(path)
                    count += 1
                except Exception as exc:  # its reads will fetch it (and say why not)
                    log.warning("lazyfs %s: prefetching %r failed: %r", self.name,
                                path[:200], exc)
        log.info("lazyfs %s: prefetched %d files of the first run (%d bytes fetched) in "
                 "%.2f s", self.name, count, fetched, time.perf_counter() - t0)
