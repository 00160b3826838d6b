"""Peer transfer (off by default): fetch snapshot chunks from a node that caches them.

``PeerRepository`` wraps the node's repository. Every manifest read through it
tells it which snapshot each chunk belongs to; ``get_chunk`` then asks the up
peers that cache that snapshot (the scheduler knows, from heartbeats) before
the repository. A peer's blob is accepted only if it decompresses to bytes of
the chunk's blake3 digest and size; otherwise the repository, which stays the
source of truth, is asked. ``read_cached_chunk`` is the serving side.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ..cluster.common import Failover
from ..snapshot import CorruptSnapshot, Manifest, Repository, SnapshotStore
from ..snapshot.chunking import compress, decompress_verified

log = logging.getLogger(__name__)
PEER_LIST_TTL = 5.0  # seconds a list of peers caching a snapshot is reused
MAX_KNOWN_CHUNKS = 1 << 20
PEER_ZSTD_LEVEL = 1  # the blob crosses a LAN once: cheap compression is enough


class PeerRepository:
    def __init__(self, repo: Repository, scheduler_url: str, api_key: str,
                 self_url: str) -> None:
        self._repo = repo
        self.description = f"{repo.description} (peer transfer on)"
        self._schedulers = Failover(scheduler_url)
        self._self_url = self_url.rstrip("/")
        self._http = httpx.Client(headers={"X-API-Key": api_key}, trust_env=False,
                                  timeout=httpx.Timeout(10.0, connect=2.0))
        self._chunks: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        self._peers: dict[str, tuple[float, list[str]]] = {}
        self._lock = threading.Lock()
        self.stats = {"peer_chunks": 0, "peer_rejected": 0, "repository_chunks": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._repo, name)

    def get_object(self, key: str) -> bytes:
        data = self._repo.get_object(key)
        if key.startswith("manifests/") and key.endswith(".json"):
            self._learn(data)
        return data

    def _learn(self, data: bytes) -> None:
        try:
            manifest = Manifest.from_json(data)
        except CorruptSnapshot:
            return
        with self._lock:
            for entry in manifest.files.values():
                for digest, size in entry.chunks:
                    self._chunks[digest] = (manifest.snapshot_id, size)
                    self._chunks.move_to_end(digest)
            while len(self._chunks) > MAX_KNOWN_CHUNKS:
                self._chunks.popitem(last=False)

    def _peers_of(self, snapshot_id: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            known = self._peers.get(snapshot_id)
        if known and known[0] > now:
            return known[1]
        urls: list[str] = []
        for scheduler in self._schedulers.order():
            try:
                r = self._http.get(f"{scheduler}/nodes",
                                   params={"snapshot": snapshot_id, "state": "up"})
                r.raise_for_status()
                urls = [n["url"].rstrip("/") for n in r.json() if n["url"].rstrip("/") !=
                        self._self_url]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.info("peer list for %s unavailable from %s (%s)", snapshot_id, scheduler,
                         exc)
                continue
            self._schedulers.answered(scheduler)
            break
        with self._lock:
            self._peers[snapshot_id] = (now + PEER_LIST_TTL, urls)
        return urls

    def get_chunk(self, digest: str) -> bytes:
        with self._lock:
            known = self._chunks.get(digest)
        if known is not None:
            snapshot_id, size = known
            for url in self._peers_of(snapshot_id):
                blob = self._from_peer(url, snapshot_id, digest, size)
                if blob is not None:
                    with self._lock:
                        self.stats["peer_chunks"] += 1
                    return blob
        with self._lock:
            self.stats["repository_chunks"] += 1
        return self._repo.get_chunk(digest)

    def _from_peer(self, url: str, snapshot_id: str, digest: str, size: int) -> bytes | None:
        try:
            r = self._http.get(f"{url}/cluster/chunks/{digest}", params={"snapshot": snapshot_id})
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            decompress_verified(r.content, digest, size, f"chunk {digest} from peer {url}")
        except CorruptSnapshot as exc:
            with self._lock:
                self.stats["peer_rejected"] += 1
            log.warning("rejected a chunk from peer %s: %s", url, exc)
            return None
        return r.content

    def close(self) -> None:
        self._http.close()
        self._repo.close()


def read_cached_chunk(store: SnapshotStore, snapshot_id: str, digest: str) -> bytes | None:
    """The chunk, compressed, from this node's cached copy of a committed snapshot
    (None when not cached here). The manifest is read from the repository: only a
    snapshot that still exists there is served."""
    if not store.is_cached(snapshot_id):
        return None
    manifest = store.get(snapshot_id)
    base: Path = store.materialize(snapshot_id)  # cached: just its path
    for rel, entry in manifest.files.items():
        offset = 0
        for d, n in entry.chunks:
            if d == digest:
                with open(base / rel, "rb") as f:
                    f.seek(offset)
                    data = f.read(n)
                return compress(data, PEER_ZSTD_LEVEL) if len(data) == n else None
            offset += n
    return None
