"""Lazily loaded layers on a node (``image_loading = "lazy"``): each layer's index in
the shared repository (converted once, by the first node to need it), a read-only
FUSE mount per layer served by a ``lazyfs`` subprocess, and the chunk cache those
processes fill, which the node's one cache budget may shrink at any time (a chunk
evicted under a running sandbox is fetched again on its next read).

Layout under ``root`` (``<images cache>/lazy``): ``index/<hex>.json.zst`` (local
copies; ``index/<hex>.chunks`` beside a converted layer's, whose chunks are in the
repository), ``mnt/<hex>`` (mount points), ``chunks/<xx>/<digest>`` (raw chunk bytes),
``logs/<hex>.log`` (each server's log).

Every use of a layer is stamped in the repository (``snapshot.image_objects``: its
index and prefetch list are collected some days after the last use), under a commit
lease and before the index is read, at most once per ``REFRESH_S`` per layer, and every
``REFRESH_S`` while it is served. A converted layer's local index copy is trusted only
while its stamp is fresh: past that its repository index is looked for again (the
collector may have taken it and its chunks).

Everything here blocks: callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentenv.snapshot import image_objects
from agentenv.snapshot.errors import ObjectMissing, SnapshotError
from agentenv.snapshot.layer_index import BadLayerIndex, LayerIndex, key_of, load
from agentenv.snapshot.lease import begin_commit
from agentenv.snapshot.repository import Repository

from .errors import HostileInput, ImageError
from .mounts import mounted_under, unmount

log = logging.getLogger(__name__)
MOUNT_TIMEOUT_S = 30.0
MOUNTS_AT_ONCE = 8
SWEEP_S = 5.0  # how often the servers' cache growth is checked against the budget
USE_LEASE_TTL_S = 120.0
USE_WAIT_S = 300.0  # a garbage collection holding the repository is waited out


class LazyLayers:
    def __init__(self, root: Path, repo: Repository, repo_config: dict[str, Any],
                 gzip_checkpoints: bool = True, prefetch: bool = True,
                 registry_timeout_s: float = 30.0):
        self.root = root
        self.repo = repo
        self.repo_config = repo_config
        self.index_dir = root / "index"
        self.mnt_dir = root / "mnt"
        self.chunks_dir = root / "chunks"
        self.logs_dir = root / "logs"
        self._lock = threading.Lock()
        self._layer_locks: dict[str, threading.Lock] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        # The node's cache budget (set by LocalCache): the servers grow the chunk cache
        # behind the node's back, so it is checked every SWEEP_S while layers are served.
        self.on_grow: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        # How long a layer server waits on a registry read before the read fails (EIO).
        self.registry_timeout_s = registry_timeout_s
        # A plain gzip layer in a registry is indexed (checkpoints) and served from the
        # registry blob; False: converted into the repository's chunks, as before.
        self.gzip_checkpoints = gzip_checkpoints
        # Each layer's server records the files its first run read (in the repository)
        # and later servers fetch them ahead (``prefetch``).
        self.prefetch = prefetch
        # Layer -> when this process last stamped its use in the repository (monotonic).
        self._stamped: dict[str, float] = {}
        self._node = socket.gethostname()

    # -- lifecycle ----------------------------------------------------------------

    def start(self, keep: Iterable[str] = ()) -> None:
        """Unmount what a crashed run left, except the layers of surviving sandboxes."""
        for d in (self.index_dir, self.mnt_dir, self.chunks_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        kept = {str(self.mnt_dir / h) for h in keep}
        for point in mounted_under(self.mnt_dir):
            if str(point) not in kept:
                log.info("images: removing stale lazy layer mount %s", point.name[:12])
                unmount(point)
        for leftover in self.chunks_dir.glob("*/.*.tmp"):
            leftover.unlink(missing_ok=True)
        self._stop.clear()
        self._sweeper = threading.Thread(target=self._sweep, name="lazy-cache", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_S):
            if self.on_grow is not None and self._procs:
                try:
                    self.on_grow()
                except Exception:  # the next sweep tries again
                    log.exception("images: chunk cache sweep failed")
            with self._lock:
                served = list(self._procs)
            for h in served:  # a layer served for days is still in use
                if not self._fresh(h):
                    with contextlib.suppress(SnapshotError), self._used(h):
                        pass

    def close(self) -> None:
        """Unmount every layer (their rootfs mounts are gone); each server then ends."""
        self._stop.set()
        for point in mounted_under(self.mnt_dir):
            unmount(point)
        with self._lock:
            procs, self._procs = dict(self._procs), {}
        for h, proc in procs.items():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("images: lazy layer server %s did not end; killing it", h[:12])
                proc.kill()
                proc.wait()

    # -- indexes -------------------------------------------------------------------

    def _fresh(self, h: str) -> bool:
        """This process stamped the layer's use less than ``REFRESH_S`` ago."""
        with self._lock:
            at = self._stamped.get(h)
        return at is not None and time.monotonic() - at < image_objects.REFRESH_S

    @contextlib.contextmanager
    def _used(self, h: str):
        """The layer's use stamped, under a commit lease held through the block: the
        collector, which reads stamps under its lock with no lease live, sees the stamp
        or the block's read of the index finds the index gone."""
        lease = begin_commit(self.repo, f"layer-{h[:16]}", USE_LEASE_TTL_S, USE_WAIT_S)
        try:
            t = time.monotonic()
            image_objects.stamp(self.repo, h, time.time(), self._node)
            yield
            with self._lock:
                self._stamped[h] = t
        finally:
            lease.release()

    def has_index(self, h: str) -> bool:
        """The layer's index is here or in the repository (then fetched and checked).
        An eStargz layer's index is only here: each node reads it from the registry."""
        local = self.index_dir / f"{h}.json.zst"
        converted = self.index_dir / f"{h}.chunks"
        if local.exists() and self._fresh(h):
            return True
        try:
            with self._used(h):
                return self._find_index(h, local, converted)
        except SnapshotError as exc:
            if local.exists() and not converted.exists():
                # Served from its registry: the repository is not needed to serve it.
                log.warning("images: use of layer %s not recorded in the repository: %s",
                            h[:12], exc)
                return True
            raise

    def has_local_index(self, h: str) -> bool:
        return (self.index_dir / f"{h}.json.zst").exists()

    def _find_index(self, h: str, local: Path, converted: Path) -> bool:
        if local.exists():
            if not converted.exists():
                return True
            try:  # its chunks are the repository's: its index must still be there
                self.repo.get_object(key_of(h))
                return True
            except ObjectMissing:
                log.info("images: layer %s was collected from the repository; indexing "
                         "it again", h[:12])
                local.unlink(missing_ok=True)
                converted.unlink(missing_ok=True)
        try:
            blob = self.repo.get_object(key_of(h))
        except ObjectMissing:
            return False
        try:  # refused here, before anything mounts it
            index = load(blob, f"layer {h[:12]} in the repository")
        except BadLayerIndex as exc:
            raise HostileInput(str(exc)) from exc
        if index.layer and index.layer != f"sha256:{h}":
            raise HostileInput(f"layer {h[:12]} in the repository: its index is of layer "
                               f"{index.layer[:80]!r}")
        self._write_local(h, blob, index)
        return True

    def _write_local(self, h: str, blob: bytes, index: LayerIndex) -> None:
        local = self.index_dir / f"{h}.json.zst"
        converted = self.index_dir / f"{h}.chunks"
        if index.blob is None:  # before the index: a copy is never trusted without it
            converted.touch()
        else:
            converted.unlink(missing_ok=True)
        tmp = local.with_name(f".{local.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, local)

    def keep_index(self, h: str, index: LayerIndex, share: bool = False) -> None:
        """The index kept on this node; ``share``: in the repository too (a plain gzip
        layer's checkpoints, which every node can use), written before the local copy."""
        if share:
            try:
                with self._used(h):
                    self.repo.put_object(key_of(h), index.dump(level=3))
            except SnapshotError as exc:  # this node serves it; others will index it too
                log.warning("images: index of layer %s not shared: %s", h[:12], exc)
        elif index.blob is None:  # converted: stamped under the conversion's lease
            with self._lock:
                self._stamped[h] = time.monotonic()
        self._write_local(h, index.dump(level=3), index)  # a local copy: fast beats small

    def layer_lock(self, h: str) -> threading.Lock:
        with self._lock:
            return self._layer_locks.setdefault(h, threading.Lock())

    # -- mounts --------------------------------------------------------------------

    def mount(self, h: str, registry_creds: dict | None = None,
              origin: tuple[str, str] | None = None) -> Path:
        """The layer's FUSE mount, started when it is not up. ``registry_creds``: for a
        layer served from its registry (eStargz, plain gzip), the image's credentials;
        ``origin``: the image's registry and repository, read instead of those the index
        names (a plain gzip layer's index may come from a node that pulled it elsewhere)."""
        point = self.mnt_dir / h
        with self.layer_lock(h):
            if self.served(h):
                return point
            if mounted_under(point):  # its server died: the mount answers nothing
                log.warning("images: lazy layer %s lost its server; mounting it again", h[:12])
                unmount(point)
            index = self.index_dir / f"{h}.json.zst"
            if not index.exists():
                raise ImageError(f"layer {h[:12]} has no index to serve")
            point.mkdir(parents=True, exist_ok=True)
            logf = open(self.logs_dir / f"{h}.log", "ab")
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "agentenv.images.lazyfs", str(index), str(point),
                     str(self.chunks_dir)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
                    start_new_session=True)  # a node's signals are not its servers'
            finally:
                logf.close()
            assert proc.stdin is not None and proc.stdout is not None
            # The settings go on stdin: nothing of them is in any process listing.
            proc.stdin.write(json.dumps({"repository": self.repo_config,
                                         "registry": registry_creds or {},
                                         "registry_timeout_s": self.registry_timeout_s,
                                         "prefetch": self.prefetch,
                                         "origin": list(origin) if origin else None})
                             .encode())
            proc.stdin.close()
            line = _read_line(proc, MOUNT_TIMEOUT_S)
            if line != "ready" or not os.path.ismount(point):
                proc.kill()
                proc.wait()
                raise ImageError(f"lazy mount of layer {h[:12]} failed: "
                                 f"{line.removeprefix('error: ') or 'no answer'}")
            with self._lock:
                self._procs[h] = proc
            log.info("images: layer %s mounted lazily (pid %d)", h[:12], proc.pid)
            return point

    def mount_all(self, hexes: list[str], registry_creds: dict | None = None,
                  origin: tuple[str, str] | None = None) -> list[Path]:
        """Every layer's mount, in order; their servers start at once (each is a Python
        process start, ~0.3 s here, paid in series before)."""
        if len(hexes) <= 1:
            return [self.mount(h, registry_creds, origin) for h in hexes]
        with ThreadPoolExecutor(min(len(hexes), MOUNTS_AT_ONCE)) as pool:
            return list(pool.map(lambda h: self.mount(h, registry_creds, origin), hexes))

    def unmount_idle(self, h: str) -> bool:
        """Unmount the layer unless something stacks on it (a rootfs overlay of another
        template holds it busy: then it stays); its server then ends. True if gone."""
        point = self.mnt_dir / h
        with self.layer_lock(h):
            if os.path.ismount(point):
                # No lazy detach: busy means still used, and that is the kernel's answer.
                subprocess.run(["umount", str(point)], capture_output=True)
                if os.path.ismount(point):
                    return False
            with self._lock:
                proc = self._procs.pop(h, None)
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            try:
                point.rmdir()
            except OSError:
                pass
        log.info("images: lazy layer %s unmounted (no template uses it)", h[:12])
        return True

    def served(self, h: str) -> bool:
        """The layer is mounted and its server answers: statfs always asks the server
        (a stat may be answered from the kernel's cached attributes)."""
        point = self.mnt_dir / h
        try:
            os.statvfs(point)
        except OSError:
            return False
        return os.path.ismount(point)

    # -- the chunk cache -------------------------------------------------------------

    def chunk_entries(self) -> list[tuple[float, str, int]]:
        """(last use, digest, bytes) of every cached chunk."""
        out = []
        for sub in self.chunks_dir.iterdir():
            try:
                with os.scandir(sub) as it:
                    for e in it:
                        if not e.name.startswith("."):
                            st = e.stat()
                            out.append((st.st_mtime, e.name, st.st_size))
            except (NotADirectoryError, FileNotFoundError):
                continue
        return out

    def chunk_bytes(self) -> int:
        return sum(size for _, _, size in self.chunk_entries())

    def evict_chunks(self, digests: Iterable[str]) -> int:
        """Drop cached chunks (read again from the repository when needed); bytes freed."""
        freed = 0
        for d in digests:
            path = self.chunks_dir / d[:2] / d
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
        return freed


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The server's first line (its mount done or its error), within ``timeout``."""
    out: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        out.append(proc.stdout.readline().decode(errors="replace").strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    reader.join(timeout=max(0.0, deadline - time.monotonic()))
    return out[0] if out else ""

