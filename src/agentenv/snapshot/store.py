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
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentenv.snapshot import chunking
from agentenv.snapshot.chunking import Chunking
from agentenv.snapshot.errors import (
    CorruptSnapshot,
    ObjectMissing,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    is_no_space,
    storage_full,
)
from agentenv.snapshot.manifest import (
    ZERO,
    FileEntry,
    Manifest,
    check_name,
    valid_name,
)
from agentenv.snapshot.repository import Repository
from agentenv.snapshot.staging import Staging

log = logging.getLogger("agentenv.snapshot")

GC_LOCK = "locks/gc"


def _now() -> float:
    return time.time()


class _Lease:
    """A repository object that says "I am working"; a heartbeat keeps it alive."""

    def __init__(self, repo: Repository, key: str, ttl: float) -> None:
        self.repo = repo
        self.key = key
        self.ttl = ttl
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok = 0.0

    def _body(self) -> bytes:
        now = _now()
        return json.dumps({"owner": self.owner, "written": now, "expires": now + self.ttl}).encode()

    def acquire(self, *, exclusive: bool = False) -> None:
        t = _now()
        self.repo.put_object(self.key, self._body(), exclusive=exclusive)
        self._last_ok = t
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease {self.key}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            t = _now()
            try:
                self.repo.put_object(self.key, self._body())
                self._last_ok = t
            except SnapshotError as exc:
                log.warning("cannot refresh %s: %s", self.key, exc)

    def valid(self) -> bool:
        """True while no one else can have seen this lease expire (with a safety margin)."""
        return _now() < self._last_ok + self.ttl * 0.75

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(SnapshotError):
            if self.key.startswith("locks/"):
                # Delete a lock only while it is still ours (a stale one may be taken over).
                body = json.loads(self.repo.get_object(self.key))
                if body.get("owner") != self.owner:
                    return
            self.repo.delete_object(self.key)


def _expired(body: bytes, now: float) -> bool:
    try:
        return float(json.loads(body)["expires"]) < now
    except (ValueError, KeyError, TypeError):
        return True


class SnapshotStore:
    """Commit, find, materialize and collect snapshots. All methods are thread-safe."""

    def __init__(self, repository: Repository, cache_dir: Path, staging_dir: Path, *,
                 threads: int = 8, lease_ttl: float = 600.0, gc_wait: float = 60.0,
                 commit_wait: float = 300.0, zstd_level: int = chunking.ZSTD_LEVEL,
                 chunker: Chunking | None = None, adopt_staging: bool = True) -> None:
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
        self._locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()
        # source sandbox -> the last snapshot this store committed from it
        self._recent: dict[str, str] = {}
        for d in (self.cache_dir, self._meta_dir, self._tmp_dir, self._manifest_cache):
            d.mkdir(parents=True, exist_ok=True)
        self.staging = Staging(self.staging_dir)

    # -- paths ------------------------------------------------------------------
    @property
    def _meta_dir(self) -> Path:
        return self.cache_dir / ".complete"

    @property
    def _tmp_dir(self) -> Path:
        return self.cache_dir / ".tmp"

    @property
    def _manifest_cache(self) -> Path:
        return self.cache_dir / ".manifests"

    def _cache_path(self, snapshot_id: str) -> Path:
        return self.cache_dir / snapshot_id

    def _marker(self, snapshot_id: str) -> Path:
        return self._meta_dir / f"{snapshot_id}.json"

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
            lease = self._begin_commit(snapshot_id)
            try:
                known = self._known_chunks(metadata)
                entries, stored, written = self._store_files(files, known)
                if not lease.valid():
                    raise SnapshotError(
                        f"commit of {snapshot_id} took longer than its lease ({self.lease_ttl}s) "
                        "could be kept alive; not committed")
                sync = getattr(self.repo, "sync_chunks", None)
                if sync is not None:
                    sync(written)
                manifest = Manifest(
                    snapshot_id=snapshot_id, alias=alias, created_at=_now(),
                    metadata=metadata, files=entries,
                    total_bytes=sum(e.size for e in entries.values()),
                    stored_bytes=stored, chunking=self.chunker.describe())
                self.repo.put_object(f"manifests/{snapshot_id}.json", manifest.to_json(),
                                     exclusive=True)
            finally:
                lease.release()
            log.info("committed snapshot %s: %d bytes, %d new bytes stored, %.2fs",
                     snapshot_id, manifest.total_bytes, stored, time.perf_counter() - t0)
            self._remember(manifest)
            if alias is not None:
                self.repo.put_object(f"aliases/{alias}", snapshot_id.encode())
            source = metadata.get("source_sandbox_id")
            if source:
                self._recent[str(source)] = snapshot_id
            if self.adopt_staging:
                self._adopt(manifest, staging)
            return manifest

    def _begin_commit(self, snapshot_id: str) -> _Lease:
        deadline = time.monotonic() + self.commit_wait
        while True:
            lease = _Lease(self.repo, f"leases/{snapshot_id}.{uuid.uuid4().hex[:12]}",
                           self.lease_ttl)
            lease.acquire()
            try:
                body = self.repo.get_object(GC_LOCK)
            except ObjectMissing:
                return lease
            except BaseException:
                lease.release()
                raise
            lease.release()
            if _expired(body, _now()):
                # A collector died holding the lock: it is stale, take it away.
                with contextlib.suppress(SnapshotError):
                    if self.repo.get_object(GC_LOCK) == body:
                        self.repo.delete_object(GC_LOCK)
                continue
            if time.monotonic() > deadline:
                raise SnapshotError("garbage collection has held the repository for "
                                    f"{self.commit_wait}s; commit of {snapshot_id} not started")
            time.sleep(0.2)

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

    def _store_files(self, files, known: set[str]):
        claimed = set(known)
        claim_lock = threading.Lock()
        written: list[str] = []

        def work(data: bytes) -> tuple[str, int, int]:
            d = chunking.digest(data)
            if d == ZERO:
                return d, len(data), 0
            with claim_lock:
                if d in claimed:
                    return d, len(data), 0
                claimed.add(d)
            if self.repo.has_chunk(d):
                return d, len(data), 0
            blob = chunking.compress(data, self.zstd_level)
            self.repo.put_chunk(d, blob)
            with claim_lock:
                written.append(d)
            return d, len(data), len(blob)

        entries: dict[str, FileEntry] = {}
        stored = 0
        limit = self.threads * 4
        pending: collections.deque[Future] = collections.deque()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="snap-commit") as pool:
            try:
                for rel, path, size, mode in files:
                    chunks: list[tuple[str, int]] = []
                    seen = 0
                    try:
                        for data in self.chunker.split(path):
                            seen += len(data)
                            pending.append(pool.submit(work, data))
                            while len(pending) >= limit:
                                stored += self._collect(pending.popleft(), chunks)
                    except SnapshotError:
                        raise
                    except OSError as exc:
                        raise SnapshotError(f"cannot read staged file {path}: {exc}") from exc
                    while pending:
                        stored += self._collect(pending.popleft(), chunks)
                    if seen != size:
                        raise SnapshotError(f"staged file {rel} changed size during commit "
                                            f"({size} -> {seen} bytes)")
                    entries[rel] = FileEntry(size=size, mode=mode, chunks=tuple(chunks))
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        return entries, stored, written

    @staticmethod
    def _collect(fut: Future, chunks: list[tuple[str, int]]) -> int:
        d, n, new = fut.result()
        chunks.append((d, n))
        return new

    def _adopt(self, manifest: Manifest, staging: Path) -> None:
        """Turn the staged files into the cache entry of the committed snapshot."""
        sid = manifest.snapshot_id
        target = self._cache_path(sid)
        try:
            if self._marker(sid).exists() or target.exists():
                shutil.rmtree(staging, ignore_errors=True)
                return
            for rel in manifest.files:
                _fsync_file(staging / rel)
            os.rename(staging, target)
            _atomic_write(self._marker(sid), manifest.to_json())
        except OSError as exc:
            # The snapshot is committed; only the local shortcut is lost.
            log.warning("snapshot %s committed, but its staging was not kept as cache: %s",
                        sid, exc)
            if exc.errno == errno.EXDEV:
                shutil.rmtree(staging, ignore_errors=True)

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
        self._remember(manifest, data)
        return manifest

    def _remember(self, manifest: Manifest, data: bytes | None = None) -> None:
        with contextlib.suppress(OSError):
            path = self._manifest_cache / f"{manifest.snapshot_id}.json"
            if not path.exists():
                _atomic_write(path, data or manifest.to_json(), sync=False)

    def _cached_manifest(self, snapshot_id: str) -> Manifest | None:
        try:
            return Manifest.from_json((self._manifest_cache / f"{snapshot_id}.json").read_bytes())
        except (OSError, CorruptSnapshot):
            return None

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
            m = self._cached_manifest(sid)
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
        self._prune_manifest_cache(set(ids))
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

    def _prune_manifest_cache(self, live: set[str]) -> None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._manifest_cache):
                sid = entry.name.removesuffix(".json")
                if entry.name.endswith(".json") and sid not in live:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

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
            with contextlib.suppress(OSError):
                (self._manifest_cache / f"{snapshot_id}.json").unlink(missing_ok=True)
            self._evict(snapshot_id)
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
        return valid_name(snapshot_id) and self._marker(snapshot_id).exists() \
            and self._cache_path(snapshot_id).is_dir()

    def evict(self, snapshot_id: str) -> None:
        """Drop the node-local copy (the repository keeps the snapshot)."""
        check_name("snapshot id", snapshot_id)
        with self._lock(snapshot_id):
            self._evict(snapshot_id)

    def _evict(self, snapshot_id: str) -> None:
        self._marker(snapshot_id).unlink(missing_ok=True)
        path = self._cache_path(snapshot_id)
        if path.exists():
            trash = self._tmp_dir / f"evict-{snapshot_id}.{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                os.rename(path, trash)
                path = trash
            shutil.rmtree(path, ignore_errors=True)

    def materialize(self, snapshot_id: str) -> Path:
        """The node-local directory holding the snapshot's files, fetched if needed.

        Every chunk is verified against its hash as it is read; a missing or
        corrupt chunk raises CorruptSnapshot and leaves no cache entry.
        """
        if self.is_cached(snapshot_id):
            return self._cache_path(snapshot_id)
        with self._lock(snapshot_id):
            if self.is_cached(snapshot_id):
                return self._cache_path(snapshot_id)
            manifest = self._fetch_manifest(snapshot_id)
            target = self._cache_path(snapshot_id)
            tmp = self._tmp_dir / f"{snapshot_id}.{uuid.uuid4().hex[:8]}"
            t0 = time.perf_counter()
            try:
                tmp.mkdir(parents=True)
                fetched = self._fetch_files(manifest, tmp)
                if target.exists():  # an incomplete entry from an interrupted run
                    self._evict(snapshot_id)
                os.rename(tmp, target)
                _atomic_write(self._marker(snapshot_id), manifest.to_json())
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
            return target

    def _local_sources(self, manifest: Manifest) -> dict[str, tuple[Path, int, int]]:
        """Chunks of related snapshots in this node's cache: digest -> (file, offset, size)."""
        md = manifest.metadata
        related: builtins.list[str] = []
        parent = md.get("parent_snapshot_id")
        if isinstance(parent, str):
            related.append(parent)
        source = md.get("source_sandbox_id")
        recent = self._recent.get(str(source)) if source else None
        if recent:
            related.append(recent)
        index: dict[str, tuple[Path, int, int]] = {}
        for sid in dict.fromkeys(r for r in related if r and valid_name(r)):
            if not self.is_cached(sid):
                continue
            try:
                other = Manifest.from_json(self._marker(sid).read_bytes())
            except (OSError, CorruptSnapshot):
                continue
            base = self._cache_path(sid)
            for rel, entry in other.files.items():
                off = 0
                for d, n in entry.chunks:
                    if d != ZERO:
                        index.setdefault(d, (base / rel, off, n))
                    off += n
        return index

    def _fetch_files(self, manifest: Manifest, dest: Path) -> int:
        local = self._local_sources(manifest)
        where: dict[str, builtins.list[tuple[int, int, int]]] = collections.defaultdict(list)
        sizes: dict[str, int] = {}
        fds: dict[str, int] = {}
        try:
            for rel, entry in manifest.files.items():
                path = dest / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, entry.mode or 0o644)
                fds[rel] = fd
                os.ftruncate(fd, entry.size)  # zero chunks stay holes
                off = 0
                for d, n in entry.chunks:
                    if d != ZERO:
                        where[d].append((fds[rel], off, n))
                        sizes[d] = n
                    off += n
                if off != entry.size:
                    raise CorruptSnapshot(f"manifest of {manifest.snapshot_id}: chunks of {rel} "
                                          f"add up to {off} bytes, not {entry.size}")

            def fetch(d: str) -> int:
                data = None
                n = sizes[d]
                if d in local:
                    data = _read_local(*local[d])
                    if data is not None and not chunking.verify_raw(data, d, n):
                        data = None
                fetched = 0
                if data is None:
                    try:
                        blob = self.repo.get_chunk(d)
                    except ObjectMissing:
                        raise CorruptSnapshot(
                            f"snapshot {manifest.snapshot_id}: chunk {d} is missing from "
                            f"{self.repo.description}") from None
                    data = chunking.decompress_verified(
                        blob, d, n, f"snapshot {manifest.snapshot_id}")
                    fetched = len(blob)
                for fd, off, _ in where[d]:
                    _pwrite_all(fd, data, off)
                return fetched

            total = _run_bounded(fetch, list(where), self.threads)
            for fd in fds.values():
                os.fsync(fd)
            return total
        finally:
            for fd in fds.values():
                os.close(fd)

    # -- garbage collection -------------------------------------------------------
    def gc(self, wait: float | None = None) -> dict:
        """Delete chunks no manifest references; returns statistics.

        Safe against concurrent commits on any node (see the module doc). When
        commits keep the repository busy for longer than ``wait`` seconds, it
        deletes nothing and says so in ``skipped``.
        """
        t0 = time.perf_counter()
        wait = self.gc_wait if wait is None else wait
        stats: dict[str, Any] = {"manifests": 0, "chunks": 0, "referenced": 0,
                                 "deleted_chunks": 0, "deleted_bytes": 0,
                                 "expired_leases": 0, "skipped": None}
        # Mark without the lock: what exists and what the manifests reference now.
        referenced: set[str] = set()
        seen: set[str] = set()
        self._gc_reference(seen, referenced)
        chunks = dict(self.repo.list_chunks())
        candidates = set(chunks) - referenced
        stats["chunks"] = len(chunks)
        lock = _Lease(self.repo, GC_LOCK, self.lease_ttl)
        if not self._take_gc_lock(lock):
            stats["skipped"] = "another garbage collection is running"
            return stats
        try:
            deadline = time.monotonic() + wait
            while True:
                live, expired = self._leases()
                for key in expired:
                    self.repo.delete_object(key)
                    stats["expired_leases"] += 1
                if not live:
                    break
                if time.monotonic() > deadline:
                    stats["skipped"] = f"{len(live)} commit(s) still in progress after {wait}s"
                    return stats
                time.sleep(0.1)
            # No commit runs now and none can start: manifests written since the mark
            # may reference candidates.
            self._gc_reference(seen, referenced)
            doomed = sorted(candidates - referenced)
            self.repo.delete_chunks(doomed)
            stats["deleted_chunks"] = len(doomed)
            stats["deleted_bytes"] = sum(chunks[d] for d in doomed)
            clean = getattr(self.repo, "clean_tmp", None)
            if clean is not None:
                stats["removed_tmp"] = clean(self.lease_ttl)
        finally:
            lock.release()
        stats["manifests"] = len(seen)
        stats["referenced"] = len(referenced & set(chunks))
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        log.info("snapshot gc: %s", stats)
        return stats

    def _gc_reference(self, seen: set[str], referenced: set[str]) -> None:
        ids = [k.removeprefix("manifests/").removesuffix(".json")
               for k in self.repo.list_objects("manifests/") if k.endswith(".json")]
        new = [sid for sid in ids if sid not in seen]
        for sid in new:
            m = self._cached_manifest(sid)
            if m is None:
                try:
                    data = self.repo.get_object(f"manifests/{sid}.json")
                except ObjectMissing:
                    continue
                # An unreadable manifest must stop the collector, not free its chunks.
                m = Manifest.from_json(data)
            referenced |= m.digests()
            seen.add(sid)

    def _take_gc_lock(self, lock: _Lease) -> bool:
        for _ in range(2):
            try:
                lock.acquire(exclusive=True)
                return True
            except SnapshotExists:
                try:
                    body = self.repo.get_object(GC_LOCK)
                except ObjectMissing:
                    continue
                if not _expired(body, _now()):
                    return False
                with contextlib.suppress(SnapshotError):
                    self.repo.delete_object(GC_LOCK)
        return False

    def _leases(self) -> tuple[builtins.list[str], builtins.list[str]]:
        live: builtins.list[str] = []
        expired: builtins.list[str] = []
        now = _now()
        for key in self.repo.list_objects("leases/"):
            try:
                body = self.repo.get_object(key)
            except ObjectMissing:
                continue
            (expired if _expired(body, now) else live).append(key)
        return live, expired


# -- helpers --------------------------------------------------------------------
def _run_bounded(fn: Callable[[Any], int], items: Iterable, threads: int) -> int:
    """Run fn over items on a thread pool with a bounded number in flight; sum the results."""
    total = 0
    pending: collections.deque[Future] = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="snap-io") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                while len(pending) >= threads * 4:
                    total += pending.popleft().result()
            while pending:
                total += pending.popleft().result()
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return total


def _read_local(path: Path, offset: int, size: int) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), size, offset)
        return data if len(data) == size else None
    except OSError:
        return None


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, *, sync: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


__all__ = ["SnapshotStore"]
