"""SnapshotStore: staging -> repository (commit) -> node-local cache (materialize).

Commit protocol (safe with several nodes and a concurrent garbage collector):
1. write a lease ``leases/<id>.<nonce>`` (refreshed by a heartbeat, it expires
   when its writer dies), then check that no garbage collection holds
   ``locks/gc``; if one does, drop the lease, wait, and start again;
2. chunk every staged file, store the chunks the repository lacks;
3. write ``manifests/<id>.json`` last, exclusively and atomically: the snapshot
   exists exactly when its manifest does. A crash before it leaves only
   unreferenced chunks, which the garbage collector removes;
4. drop the lease; point the alias (if any) at the new snapshot.

The collector takes ``locks/gc``, waits until no live lease remains, and only
then deletes chunks that no manifest references. Each side writes its own
object before reading the other's, so at least one of them sees the other: a
commit never relies on a chunk the collector is deleting.

The parts live in their own modules: ``lease`` (the handshake), ``upload``
(storing chunks), ``cache`` (the node cache's layout), ``fetch`` (materialize's
download) and ``gc`` (the collector); this class ties them together.
"""

from __future__ import annotations

import builtins
import collections
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.metrics import SNAPSHOT_BYTES, cache_lookup
from agentenv.snapshot import chunking, image_objects
from agentenv.snapshot.cache import NodeCache
from agentenv.snapshot.chunking import Chunking
from agentenv.snapshot.collector import collect_garbage
from agentenv.snapshot.errors import (
    CorruptSnapshot,
    ObjectMissing,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    is_no_space,
    storage_full,
)
from agentenv.snapshot.fetch import fetch_files, local_chunks
from agentenv.snapshot.lease import begin_commit
from agentenv.snapshot.manifest import Manifest, check_name, valid_name
from agentenv.snapshot.repository import Repository
from agentenv.snapshot.staging import Staging
from agentenv.snapshot.upload import StagedFile, store_files

log = logging.getLogger("agentenv.snapshot")


class SnapshotStore:
    """Commit, find, materialize and collect snapshots. All methods are thread-safe."""

    def __init__(self, repository: Repository, cache_dir: Path, staging_dir: Path, *,
                 threads: int = 8, lease_ttl: float = 600.0, gc_wait: float = 60.0,
                 commit_wait: float = 300.0, zstd_level: int = chunking.ZSTD_LEVEL,
                 chunker: Chunking | None = None, adopt_staging: bool = True,
                 image_retention_s: float = image_objects.RETENTION_S,
                 image_budget_bytes: int = 0) -> None:
        self.repo = repository
        self.cache_dir = Path(cache_dir)
        self.staging_dir = Path(staging_dir)
        self.threads = max(1, threads)
        self.lease_ttl = lease_ttl
        self.gc_wait = gc_wait
        self.commit_wait = commit_wait
        self.zstd_level = zstd_level
        self.chunker = chunker or Chunking()
        self.adopt_staging = adopt_staging
        # Lazily loaded images' indexes and prefetch lists: kept this long after their
        # last use, and within this many bytes (0: no bound); ``image_objects``.
        self.image_retention_s = image_retention_s
        self.image_budget_bytes = image_budget_bytes
        self._locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()
        # source sandbox -> the last snapshot this store committed from it
        self._recent: dict[str, str] = {}
        self.cache = NodeCache(self.cache_dir)
        self.staging = Staging(self.staging_dir)
        # Called (with no lock held) after the cache grew: the node keeps its budget.
        self.on_grow: Callable[[], None] | None = None

    def _lock(self, snapshot_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks[snapshot_id]

    # -- staging (the layout is staging.Staging's) ------------------------------------
    def new_staging(self, snapshot_id: str) -> Path:
        """An empty directory for the runtime to write a capture into."""
        return self.staging.new(snapshot_id)

    def discard_staging(self, snapshot_id: str) -> None:
        """Remove a capture (and, for a pending pause, its metadata)."""
        self.staging.discard(snapshot_id)

    # -- commit -----------------------------------------------------------------
    def commit(self, snapshot_id: str, staging: Path, metadata: dict,
               alias: str | None = None) -> Manifest:
        """Store a staged capture; the manifest is written last and atomically.

        On success the staging directory is consumed: its files become this
        node's cache of the snapshot (a restore here needs no download). On
        failure it is left as it was, so the commit can be retried.
        """
        check_name("snapshot id", snapshot_id)
        if alias is not None:
            check_name("alias", alias)
        staging = Path(staging)
        metadata = dict(metadata or {})
        json.dumps(metadata)  # fail early on what the manifest cannot hold
        with self._lock(snapshot_id):
            if self._manifest_exists(snapshot_id):
                raise SnapshotExists(f"snapshot {snapshot_id} already exists")
            files = Staging.files(staging)
            t0 = time.perf_counter()
            manifest, stored, written, spans = self._upload(snapshot_id, files, metadata, alias)
            log.info("committed snapshot %s: %d bytes, %d new bytes stored, %.2fs",
                     snapshot_id, manifest.total_bytes, stored, time.perf_counter() - t0)
            SNAPSHOT_BYTES.labels("captured").inc(manifest.total_bytes)
            SNAPSHOT_BYTES.labels("stored").inc(stored)
            self.cache.remember(manifest)
            if alias is not None:
                self.repo.put_object(f"aliases/{alias}", snapshot_id.encode())
            source = metadata.get("source_sandbox_id")
            if source:
                self._recent[str(source)] = snapshot_id
            if self.adopt_staging:
                self.cache.adopt(manifest, staging)
            spans["adopt"] = time.perf_counter()
            if log.isEnabledFor(logging.DEBUG):
                last, parts = t0, []
                for name, at in spans.items():
                    parts.append(f"{name} {(at - last) * 1000:.0f}")
                    last = at
                log.debug("commit of %s, ms: %s; %d chunks written", snapshot_id,
                          ", ".join(parts), len(written))
        self._grew()
        return manifest

    def _upload(self, snapshot_id: str, files: builtins.list[StagedFile], metadata: dict,
                alias: str | None) -> tuple[Manifest, int, builtins.list[str], dict[str, float]]:
        """Under a commit lease: the chunks the repository lacks, then the manifest.
        Returns it, the new bytes stored, the digests written and when each step ended."""
        lease = begin_commit(self.repo, snapshot_id, self.lease_ttl, self.commit_wait)
        spans = {"lease": time.perf_counter()}
        try:
            known = self._known_chunks(metadata)
            spans["known"] = time.perf_counter()
            entries, stored, written = store_files(
                self.repo, self.chunker, files, known,
                threads=self.threads, zstd_level=self.zstd_level)
            spans["chunks"] = time.perf_counter()
            if not lease.valid():
                raise SnapshotError(
                    f"commit of {snapshot_id} took longer than its lease ({self.lease_ttl}s) "
                    "could be kept alive; not committed")
            sync = getattr(self.repo, "sync_chunks", None)
            if sync is not None:
                sync(written, self.threads)
            spans["sync"] = time.perf_counter()
            manifest = Manifest(
                snapshot_id=snapshot_id, alias=alias, created_at=time.time(),
                metadata=metadata, files=entries,
                total_bytes=sum(e.size for e in entries.values()),
                stored_bytes=stored, chunking=self.chunker.describe())
            self.repo.put_object(f"manifests/{snapshot_id}.json", manifest.to_json(),
                                 exclusive=True)
            spans["manifest"] = time.perf_counter()
        finally:
            lease.release()
        spans["release"] = time.perf_counter()
        return manifest, stored, written, spans

    def _known_chunks(self, metadata: dict) -> set[str]:
        """Chunks surely present: those of committed snapshots this one probably shares.

        Read after the lease is taken, so the collector cannot remove them now.
        """
        known: set[str] = set()
        candidates = [metadata.get("parent_snapshot_id"),
                      self._recent.get(str(metadata.get("source_sandbox_id")))]
        for sid in dict.fromkeys(c for c in candidates if isinstance(c, str) and valid_name(c)):
            try:
                known |= self._fetch_manifest(sid).digests()
            except (SnapshotNotFound, CorruptSnapshot):
                continue
        return known

    # -- reading ----------------------------------------------------------------
    def _manifest_exists(self, snapshot_id: str) -> bool:
        try:
            self.repo.get_object(f"manifests/{snapshot_id}.json")
            return True
        except ObjectMissing:
            return False

    def _fetch_manifest(self, snapshot_id: str) -> Manifest:
        """The committed manifest, read from the repository (proves it still exists)."""
        if not valid_name(snapshot_id):
            raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found")
        try:
            data = self.repo.get_object(f"manifests/{snapshot_id}.json")
        except ObjectMissing:
            raise SnapshotNotFound(f"snapshot {snapshot_id} not found") from None
        manifest = Manifest.from_json(data)
        self.cache.remember(manifest, data)
        return manifest

    def _alias_target(self, alias: str) -> str | None:
        try:
            return self.repo.get_object(f"aliases/{alias}").decode().strip()
        except ObjectMissing:
            return None

    def get(self, snapshot_id: str) -> Manifest:
        manifest = self._fetch_manifest(snapshot_id)
        if manifest.alias and self._alias_target(manifest.alias) != snapshot_id:
            manifest = manifest.with_alias(None)
        return manifest

    def resolve(self, id_or_alias: str) -> Manifest:
        """A snapshot by ID, else by alias."""
        try:
            return self.get(id_or_alias)
        except SnapshotNotFound:
            pass
        if valid_name(id_or_alias):
            target = self._alias_target(id_or_alias)
            if target is not None:
                try:
                    return self._fetch_manifest(target).with_alias(id_or_alias)
                except SnapshotNotFound:
                    raise SnapshotNotFound(f"alias {id_or_alias} points to snapshot {target}, "
                                           "which no longer exists") from None
        raise SnapshotNotFound(f"no snapshot with ID or alias {id_or_alias!r}")

    def set_alias(self, alias: str, snapshot_id: str) -> None:
        """Point an alias at a snapshot (atomically replacing where it pointed before)."""
        check_name("alias", alias)
        self._fetch_manifest(snapshot_id)
        self.repo.put_object(f"aliases/{alias}", snapshot_id.encode())

    def list(self, source_sandbox_id: str | None = None,
             template_id: str | None = None) -> list[Manifest]:
        """Committed snapshots, oldest first; filters match the commit's metadata."""
        ids = [k.removeprefix("manifests/").removesuffix(".json")
               for k in self.repo.list_objects("manifests/") if k.endswith(".json")]
        alias_keys = self.repo.list_objects("aliases/")
        manifests: list[Manifest] = []
        missing = []
        for sid in ids:
            m = self.cache.manifest(sid)
            if m is None:
                missing.append(sid)
            else:
                manifests.append(m)
        aliases: dict[str, set[str]] = collections.defaultdict(set)
        with ThreadPoolExecutor(min(self.threads, 16), thread_name_prefix="snap-list") as pool:
            fetched = pool.map(self._fetch_or_none, missing)
            targets = pool.map(lambda k: (k, self._alias_target(k.removeprefix("aliases/"))),
                               alias_keys)
            manifests.extend(m for m in fetched if m is not None)
            for key, target in targets:
                if target:
                    aliases[target].add(key.removeprefix("aliases/"))
        self.cache.prune_manifests(set(ids))
        out = []
        for m in manifests:
            md = m.metadata
            if source_sandbox_id is not None and md.get("source_sandbox_id") != source_sandbox_id:
                continue
            if template_id is not None and md.get("template_id") != template_id:
                continue
            names = aliases.get(m.snapshot_id, set())
            current = m.alias if m.alias in names else min(names, default=None)
            out.append(m.with_alias(current))
        out.sort(key=lambda m: (m.created_at, m.snapshot_id))
        return out

    def _fetch_or_none(self, sid: str) -> Manifest | None:
        try:
            return self._fetch_manifest(sid)
        except SnapshotNotFound:
            return None

    # -- delete -----------------------------------------------------------------
    def delete(self, snapshot_id: str) -> None:
        """Delete the manifest (the snapshot is gone from then on), its alias and cache.

        Its chunks are removed by the next gc() unless other snapshots use them.
        """
        with self._lock(snapshot_id):
            manifest = self._fetch_manifest(snapshot_id)
            self.repo.delete_object(f"manifests/{snapshot_id}.json")
            for alias in {a for a in (manifest.alias, *self._aliases_to(snapshot_id)) if a}:
                if self._alias_target(alias) == snapshot_id:
                    self.repo.delete_object(f"aliases/{alias}")
            self.cache.forget(snapshot_id)
            self.cache.evict(snapshot_id)
            for src, sid in list(self._recent.items()):
                if sid == snapshot_id:
                    self._recent.pop(src, None)

    def _aliases_to(self, snapshot_id: str) -> set[str]:
        out = set()
        for key in self.repo.list_objects("aliases/"):
            name = key.removeprefix("aliases/")
            if self._alias_target(name) == snapshot_id:
                out.add(name)
        return out

    # -- node-local cache ---------------------------------------------------------
    def is_cached(self, snapshot_id: str) -> bool:
        return self.cache.is_cached(snapshot_id)

    def evict(self, snapshot_id: str) -> None:
        """Drop the node-local copy (the repository keeps the snapshot)."""
        check_name("snapshot id", snapshot_id)
        with self._lock(snapshot_id):
            self.cache.evict(snapshot_id)

    def cache_entries(self) -> dict[str, tuple[float, int]]:
        """The node cache's complete entries: snapshot ID -> (last use, bytes)."""
        return self.cache.entries()

    def evict_unused(self, snapshot_id: str, since: float) -> bool:
        """Drop the node-local copy unless it is being materialized or was used after
        ``since`` (a restore reads it then); True when dropped."""
        lock = self._lock(snapshot_id)
        if not lock.acquire(blocking=False):
            return False
        try:
            used = self.cache.used_at(snapshot_id)
            if used is None or used > since:
                return False
            self.cache.evict(snapshot_id)
            return True
        finally:
            lock.release()

    def materialize(self, snapshot_id: str) -> Path:
        """The node-local directory holding the snapshot's files, fetched if needed.

        Every chunk is verified against its hash as it is read; a missing or
        corrupt chunk raises CorruptSnapshot and leaves no cache entry.
        """
        return self._materialize(snapshot_id)

    def _grew(self) -> None:
        if self.on_grow is not None:
            try:
                self.on_grow()
            except Exception:  # the budget is kept at the next growth
                log.exception("keeping the node cache within its budget failed")

    def _materialize(self, snapshot_id: str) -> Path:
        # Under the entry's lock even when cached: marked used before an eviction
        # (which takes the lock and spares what was used lately) can see it.
        with self._lock(snapshot_id):
            if self.is_cached(snapshot_id):
                cache_lookup("snapshot", hit=True)
                self.cache.touch(snapshot_id)
                return self.cache.path(snapshot_id)
            cache_lookup("snapshot", hit=False)
            manifest = self._fetch_manifest(snapshot_id)
            tmp = self.cache.new_tmp(snapshot_id)
            t0 = time.perf_counter()
            try:
                tmp.mkdir(parents=True)
                local = local_chunks(self.cache, self._related(manifest))
                fetched = fetch_files(manifest, tmp, self.repo, local, self.threads)
                target = self.cache.install(manifest, tmp)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if is_no_space(exc):
                    raise storage_full(f"materializing snapshot {snapshot_id} into "
                                       f"{self.cache_dir}", exc) from exc
                raise SnapshotError(f"cannot materialize snapshot {snapshot_id}: {exc}") \
                    from exc
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("materialized snapshot %s: %d bytes (%d from the repository) in %.2fs",
                     snapshot_id, manifest.total_bytes, fetched, time.perf_counter() - t0)
            self.cache.touch(snapshot_id)
        self._grew()
        return target

    def _related(self, manifest: Manifest) -> builtins.list[str]:
        """Snapshots likely to share chunks with this one: its parent, the last one
        this store committed from the same sandbox, and cached ones of the same
        template (a snapshot made on another node shares most of its memory with
        this node's boot image of the template: only the rest is fetched)."""
        md = manifest.metadata
        related: builtins.list[str] = []
        parent = md.get("parent_snapshot_id")
        if isinstance(parent, str):
            related.append(parent)
        source = md.get("source_sandbox_id")
        recent = self._recent.get(str(source)) if source else None
        if recent:
            related.append(recent)
        template = md.get("template_id")
        if isinstance(template, str) and template:
            related += self.cache.of_template(template)
        return related

    # -- garbage collection -------------------------------------------------------
    def gc(self, wait: float | None = None) -> dict:
        """Delete chunks no manifest or kept layer index references, and image layers'
        objects past their retention (``image_objects``); returns statistics.

        Safe against concurrent commits on any node (see the module doc). When
        commits keep the repository busy for longer than ``wait`` seconds, it
        deletes nothing and says so in ``skipped``.
        """
        return collect_garbage(self.repo, lease_ttl=self.lease_ttl,
                               wait=self.gc_wait if wait is None else wait,
                               cached_manifest=self.cache.manifest,
                               image_retention_s=self.image_retention_s,
                               image_budget_bytes=self.image_budget_bytes)


__all__ = ["SnapshotStore"]
