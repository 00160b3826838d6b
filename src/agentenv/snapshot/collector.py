"""Garbage collection: delete the repository's chunks that no manifest references.

Mark (without the lock), take ``locks/gc``, wait until no commit lease is live,
mark again (manifests written meanwhile may reference candidates), then sweep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agentenv.snapshot.errors import ObjectMissing
from agentenv.snapshot.layer_index import PREFIX, load
from agentenv.snapshot.lease import GC_LOCK, Lease, scan_leases, take_gc_lock
from agentenv.snapshot.manifest import Manifest
from agentenv.snapshot.repository import Repository

log = logging.getLogger("agentenv.snapshot")


def collect_garbage(repo: Repository, *, lease_ttl: float, wait: float,
                    cached_manifest: Callable[[str], Manifest | None]) -> dict:
    """Delete unreferenced chunks; returns statistics.

    ``cached_manifest`` answers from the node's manifest cache (None when it has
    no copy); manifests are immutable, so a cached copy is as good as the
    repository's. When commits keep the repository busy for longer than ``wait``
    seconds, nothing is deleted and ``skipped`` says why.
    """
    t0 = time.perf_counter()
    stats: dict[str, Any] = {"manifests": 0, "chunks": 0, "referenced": 0,
                             "deleted_chunks": 0, "deleted_bytes": 0,
                             "expired_leases": 0, "skipped": None}
    # Mark without the lock: what exists and what the manifests reference now.
    referenced: set[str] = set()
    seen: set[str] = set()
    _reference(repo, cached_manifest, seen, referenced)
    chunks = dict(repo.list_chunks())
    candidates = set(chunks) - referenced
    stats["chunks"] = len(chunks)
    lock = Lease(repo, GC_LOCK, lease_ttl)
    if not take_gc_lock(lock):
        stats["skipped"] = "another garbage collection is running"
        return stats
    try:
        deadline = time.monotonic() + wait
        while True:
            live, stale = scan_leases(repo)
            for key in stale:
                repo.delete_object(key)
                stats["expired_leases"] += 1
            if not live:
                break
            if time.monotonic() > deadline:
                stats["skipped"] = f"{len(live)} commit(s) still in progress after {wait}s"
                return stats
            time.sleep(0.1)
        # No commit runs now and none can start: manifests written since the mark
        # may reference candidates.
        _reference(repo, cached_manifest, seen, referenced)
        doomed = sorted(candidates - referenced)
        repo.delete_chunks(doomed)
        stats["deleted_chunks"] = len(doomed)
        stats["deleted_bytes"] = sum(chunks[d] for d in doomed)
        clean = getattr(repo, "clean_tmp", None)
        if clean is not None:
            stats["removed_tmp"] = clean(lease_ttl)
    finally:
        lock.release()
    stats["manifests"] = len(seen)
    stats["referenced"] = len(referenced & set(chunks))
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    log.info("snapshot gc: %s", stats)
    return stats


def _reference(repo: Repository, cached_manifest: Callable[[str], Manifest | None],
               seen: set[str], referenced: set[str]) -> None:
    """Add the chunks of every manifest not in ``seen`` yet to ``referenced``."""
    ids = [k.removeprefix("manifests/").removesuffix(".json")
           for k in repo.list_objects("manifests/") if k.endswith(".json")]
    new = [sid for sid in ids if sid not in seen]
    for sid in new:
        m = cached_manifest(sid)
        if m is None:
            try:
                data = repo.get_object(f"manifests/{sid}.json")
            except ObjectMissing:
                continue
            # An unreadable manifest must stop the collector, not free its chunks.
            m = Manifest.from_json(data)
        referenced |= m.digests()
        seen.add(sid)
    # Lazily loaded image layers reference chunks too.
    for key in repo.list_objects(PREFIX):
        if key in seen:
            continue
        try:
            data = repo.get_object(key)
        except ObjectMissing:
            continue
        # An unreadable index must stop the collector, not free its chunks.
        referenced |= load(data, key).digests()
        seen.add(key)
