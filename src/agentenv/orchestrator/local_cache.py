"""The node-local cache's one budget: image layers and materialized snapshots together.

Both grow on use (a pull, an image template's refetch, a restore or fork that
materializes a snapshot, a commit that keeps its capture as cache). When the total
passes the budget the least recently used of either kind go first, but never

- a layer a starting, running or resuming sandbox or a pinned template uses (the
  image service's protection: a running sandbox's rootfs is a mount of it, and
  there is no fetching a layer again under a live mount);
- a snapshot entry being materialized or used in the last ``grace_s`` seconds (a
  restore reads its files then; afterwards the sandbox runs from memory), nor the
  snapshot of a pinned template;
- anything in the repository or in staging: every snapshot entry here is a copy of
  a committed snapshot, fetched again on its next use.

Chunks of lazily loaded layers (``images.service``: lazy by choice or by size) are a
third kind, by chunk, and nothing protects them: a layer's FUSE server fetches an
evicted chunk again on its next read (a file already read stays in the kernel's page
cache).

Called from worker threads; one eviction pass at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..config import Config
from ..images import DEFAULT_MOUNTPOINTS, ImageService, LayerStore, LazyLayers
from ..metrics import EVICTIONS
from ..snapshot import SnapshotStore
from ..templates import TemplateRegistry
from .specs import BUNDLE_MOUNT

log = logging.getLogger(__name__)
GRACE_S = 300.0


def node_images(config: Config, templates: TemplateRegistry, snapshots: SnapshotStore,
                in_use: Callable[[], set[str]]) -> ImageService:
    """The node's pulled OCI images: their layers, and the rootfs mounts of image
    templates (``in_use``: the templates whose rootfs must stay mounted)."""
    # Always there: a pull may ask for lazy loading whatever the node's default.
    lazy = LazyLayers(config.images_cache_dir / "lazy", snapshots.repo,
                      config.snapshot_repository(), gzip_checkpoints=config.image_gzip_index,
                      prefetch=config.image_prefetch,
                      registry_timeout_s=config.image_registry_timeout_s)
    return ImageService(
        LayerStore(config.images_cache_dir, config.cache_budget(),
                   mountpoints=(*DEFAULT_MOUNTPOINTS, BUNDLE_MOUNT)), templates,
        config.secrets_dir, in_use=in_use,
        pinned=[n.strip() for n in config.pinned_templates.split(",") if n.strip()],
        local_sources_dir=config.image_imports_dir,
        lazy=lazy, loading=config.image_loading, lazy_above=config.image_lazy_above_mb << 20)


class LocalCache:
    def __init__(self, budget: int, images: ImageService, snapshots: SnapshotStore,
                 pinned_snapshots: Callable[[], set[str]] = set, grace_s: float = GRACE_S):
        self.budget = budget
        self.images = images
        self.snapshots = snapshots
        self.pinned_snapshots = pinned_snapshots
        self.grace_s = grace_s
        self._lock = threading.Lock()
        images.room = self.make_room
        snapshots.on_grow = self.make_room
        if images.lazy is not None:
            images.lazy.on_grow = self.make_room

    def _chunks(self) -> list[tuple[float, str, int]]:
        lazy = self.images.lazy
        return lazy.chunk_entries() if lazy is not None else []

    def usage(self) -> dict:
        layers = self.images.store.total() + sum(s for _, _, s in self._chunks())
        snaps = sum(size for _, size in self.snapshots.cache_entries().values())
        return {"bytes": layers + snaps, "budget": self.budget, "imageBytes": layers,
                "snapshotBytes": snaps}

    def make_room(self, need: int = 0) -> None:
        """Evict least recently used entries until ``need`` more bytes fit (as far as
        what is protected allows)."""
        with self._lock:
            entries = self.snapshots.cache_entries()
            chunks = self._chunks()
            total = self.images.store.total() + sum(s for _, s in entries.values()) + need + \
                sum(s for _, _, s in chunks)
            if total <= self.budget:
                return
            cutoff = time.time() - self.grace_s
            pinned = self.pinned_snapshots()
            candidates: list[tuple[float, str, str, int]] = [
                (used, "layer", h, size) for used, h, size in self.images.evictable()]
            candidates += [(used, "chunk", d, size) for used, d, size in chunks]
            candidates += [(used, "snapshot", sid, size) for sid, (used, size) in entries.items()
                           if used <= cutoff and sid not in pinned]
            candidates.sort()
            layers: list[str] = []
            cold: list[str] = []
            for _, kind, key, size in candidates:
                if total <= self.budget:
                    break
                if kind == "layer":
                    layers.append(key)
                    total -= size
                elif kind == "chunk":
                    cold.append(key)
                    total -= size
                elif self.snapshots.evict_unused(key, cutoff):
                    log.info("node cache: evicted snapshot %s (LRU, over budget)", key)
                    EVICTIONS.labels("snapshot").inc()
                    total -= size
            if layers:
                self.images.evict_layers(layers)
            if cold and self.images.lazy is not None:
                freed = self.images.lazy.evict_chunks(cold)
                log.info("node cache: evicted %d image chunks, %d bytes (LRU, over budget)",
                         len(cold), freed)
                EVICTIONS.labels("image_chunk").inc(len(cold))
