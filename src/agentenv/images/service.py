"""Images on a node: pull an image into the layer store and make it a template;
ensure a template's rootfs (layers fetched again if evicted, then mounted) before
a sandbox starts; keep the store within its budget.

Everything here blocks (network, disk, mount): callers run it in a thread.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..metrics import EVICTIONS, cache_lookup
from ..templates import ImageInfo, Template, TemplateNotFound, TemplateRegistry
from .errors import BadReference, CacheTooSmall, ImageError, ImageInUse, ImageNotFound
from .lazy import LazyLayers
from .lazy_index import index_layer
from .manifest import Image, Layer
from .mounts import mount_layers, mounted_under, unmount
from .reference import ArchiveRef, LayoutRef, parse_reference, registry_origin
from .sources import RegistrySource, Source, open_source
from .store import LayerStore, hex_of
from .template_record import template_record
from .unpack import unpack_layer

log = logging.getLogger(__name__)
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
PARALLEL_LAYERS = 3
Progress = Callable[[dict], None]
LOADINGS = ("auto", "lazy", "unpack")


class ImageService:
    def __init__(self, store: LayerStore, templates: TemplateRegistry, secrets_dir: Path,
                 in_use: Callable[[], set[str]] = set, pinned: Iterable[str] = (),
                 local_sources_dir: Path | None = None, lazy: LazyLayers | None = None,
                 loading: str = "unpack", lazy_above: int = 0):
        self.store = store
        # Set: an image can be loaded lazily (its layers indexed, or converted into the
        # repository, and served by FUSE mounts, never unpacked here).
        self.lazy = lazy
        # How a pull loads an image unless its request says: "unpack", "lazy", or
        # "auto" (lazily when its compressed layers exceed ``lazy_above`` bytes).
        if loading not in LOADINGS:
            raise ValueError(f"image loading {loading!r} is not one of {LOADINGS}")
        self.loading = loading
        self.lazy_above = lazy_above
        # When set, oci-layout:/docker-archive: paths must lie below it.
        self.local_sources_dir = local_sources_dir
        self.templates = templates
        self.secrets_dir = secrets_dir / "images"
        # Template IDs whose rootfs must stay (running sandboxes, boots under way).
        self.in_use = in_use
        self.pinned = set(pinned)
        self._lock = threading.RLock()
        self._template_locks: dict[str, threading.Lock] = {}
        # Layers a pull or an ensure is working with right now: never evicted.
        self._busy: dict[str, int] = {}
        # Set by the node: keeps its one cache budget (layers and snapshots) instead.
        self.room: Callable[[int], None] | None = None
        # Called with a template's ID each time its rootfs is ensured (a sandbox starts).
        self.on_use: Callable[[str], None] | None = None

    @property
    def mounts_dir(self) -> Path:
        return self.templates.rootfs_dir

    # -- lifecycle ----------------------------------------------------------------

    def start(self, keep_templates: Iterable[str] = ()) -> None:
        """Open the store; unmount rootfs mounts a crashed run left, except those of
        templates whose sandboxes survived it."""
        self.store.open()
        self.mounts_dir.mkdir(parents=True, exist_ok=True)
        kept = [t for t in self._image_templates() if t.template_id in set(keep_templates)]
        keep = {t.rootfs for t in kept}
        for point in mounted_under(self.mounts_dir):
            if point not in keep:
                log.info("images: removing stale rootfs mount %s", point)
                unmount(point)
        for d in self.mounts_dir.iterdir():
            if d not in keep and not os.path.ismount(d):
                shutil.rmtree(d, ignore_errors=True)
        if self.lazy is not None:  # after the rootfs mounts above its layers are gone
            self.lazy.start(keep={hex_of(d) for t in kept if t.image for d, _ in t.image.layers})

    def close(self) -> None:
        """Unmount every rootfs (the node's sandboxes are gone)."""
        for point in mounted_under(self.mounts_dir):
            unmount(point)
        if self.lazy is not None:
            self.lazy.close()

    # -- pull -----------------------------------------------------------------------

    def _check_local_source(self, ref: str) -> None:
        parsed = parse_reference(ref)
        if self.local_sources_dir is None or not isinstance(parsed, LayoutRef | ArchiveRef):
            return
        root = self.local_sources_dir.resolve()
        if not parsed.path.resolve().is_relative_to(root):
            raise BadReference(f"local image sources must be under {root} (image_import_dir)")

    def pull(self, ref: str, name: str, credentials: dict | None = None,
             progress: Progress | None = None,
             cancel: threading.Event | None = None, loading: str | None = None) -> dict:
        """Pull ``ref`` into the store and write template ``name``; its template.json.
        ``loading`` ("auto", "lazy", "unpack"; None: the node's) is kept in the template
        (its later starts, on any node, load it the same way)."""
        emit = progress or (lambda _: None)
        if loading is not None and loading not in LOADINGS:
            raise BadReference(f"loading must be one of {', '.join(LOADINGS)}")
        if not NAME.match(name or ""):
            raise BadReference("name must be 1-63 of a-z, 0-9, '-', '_' (starting with a "
                               "letter or digit)")
        self._check_name_free(name)
        user, password = _creds(credentials)
        emit({"status": "resolving", "image": ref})
        self._check_local_source(ref)
        source = open_source(ref, user, password)
        try:
            image = source.resolve()
            compressed = sum(layer.size for layer in image.layers)
            lazy = self._lazy_for(loading or self.loading, compressed,
                                  isinstance(source, RegistrySource))
            # Lazily loaded, nothing of a layer must fit at once: chunks come and go.
            if not lazy and compressed > self.store.budget:
                raise CacheTooSmall(f"image needs at least {compressed} bytes; the image cache "
                                    f"budget is {self.store.budget} (local_cache_bytes)")
            emit({"status": "resolved", "manifestDigest": image.manifest_digest,
                  "layers": [{"digest": x.digest, "size": x.size} for x in image.layers],
                  "loading": "lazy" if lazy else "unpack"})
            self._fetch(source, image, ref, emit, cancel, lazy)
        finally:
            source.close()
        unpacked = sum(self.store.size(hex_of(x.digest)) for x in image.layers)
        if not lazy and unpacked > self.store.budget:
            raise CacheTooSmall(f"image unpacks to {unpacked} bytes; the image cache budget is "
                                f"{self.store.budget} (local_cache_bytes)")
        record = self._write_template(name, ref, image, credentials, lazy)
        self.store.touch(hex_of(x.digest) for x in image.layers)
        self._make_room()
        emit({"status": "done", "template": record})
        return record

    def _lazy_for(self, loading: str, compressed: int, registry: bool) -> bool:
        """Whether an image of ``compressed`` bytes of layers is loaded lazily. "auto"
        leaves local archives unpacked: lazily they would be converted, dearer than an
        unpack (the threshold was measured on registry gzip layers read by range)."""
        if self.lazy is None:
            return False
        if loading == "auto":
            return registry and compressed > self.lazy_above
        return loading == "lazy"

    def is_lazy(self, info: ImageInfo) -> bool:
        """Whether a template's layers are served lazily (as chosen at its pull)."""
        if self.lazy is None:
            return False
        if info.loading:
            return info.loading == "lazy"
        return self.loading == "lazy"  # a record from before the choice was kept

    def _check_name_free(self, name: str) -> None:
        try:
            existing = self.templates.get(name)
        except TemplateNotFound:
            return
        if existing.image is None:
            raise ImageInUse(f"template '{name}' exists and is not an image template")

    def _fetch(self, source: Source, image: Image, ref: str, emit: Progress,
               cancel: threading.Event | None, lazy: bool) -> None:
        hexes = [hex_of(x.digest) for x in image.layers]
        self._hold(hexes)
        try:
            missing = [x for x in image.layers if not self._have(hex_of(x.digest), lazy)]
            for layer in image.layers:
                if layer not in missing:
                    emit({"status": "cached", "digest": layer.digest, "size": layer.size})
            if not missing:
                return
            with ThreadPoolExecutor(min(PARALLEL_LAYERS, len(missing))) as pool:
                futures = [pool.submit(self._fetch_layer, source, layer, ref, emit, cancel,
                                       lazy) for layer in missing]
                errors = [f.exception() for f in futures]
            for exc in errors:
                if exc is not None:
                    if cancel is not None:
                        cancel.set()
                    raise exc
        finally:
            self._release(hexes)

    def _fetch_layer(self, source: Source, layer: Layer, ref: str, emit: Progress,
                     cancel: threading.Event | None, lazy: bool) -> None:
        h = hex_of(layer.digest)
        last = [0.0]

        def report(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.2:
                last[0] = now
                emit({"status": "downloading", "digest": layer.digest, "size": layer.size,
                      "done": done})

        def unpack(dest: Path):
            with source.layer(layer) as chunks:
                return unpack_layer(
                    chunks, dest, digest=layer.digest if source.blob_digests else "",
                    diff_id=layer.diff_id, declared_size=layer.size,
                    max_bytes=self.store.budget, what=f"layer {layer.digest[:19]}",
                    progress=report, cancel=cancel)

        t0 = time.perf_counter()
        if lazy:
            assert self.lazy is not None
            index_layer(self.lazy, source, layer, report, cancel)
            emit({"status": "done-layer", "digest": layer.digest, "size": layer.size,
                  "seconds": round(time.perf_counter() - t0, 3)})
            return
        self._make_room(need=layer.size)
        fetched = self.store.add(h, unpack, ref)
        emit({"status": "done-layer" if fetched else "cached", "digest": layer.digest,
              "size": layer.size, "unpacked": self.store.size(h),
              "seconds": round(time.perf_counter() - t0, 3)})

    def _have(self, h: str, lazy: bool) -> bool:
        if lazy:
            assert self.lazy is not None
            return self.lazy.has_index(h)
        return self.store.has(h)

    def _here(self, h: str, lazy: bool) -> bool:
        if lazy:
            assert self.lazy is not None
            return self.lazy.has_local_index(h)
        return self.store.has(h)

    def _write_template(self, name: str, ref: str, image: Image,
                        credentials: dict | None, lazy: bool) -> dict:
        directory = self.templates.local_dir / name
        directory.mkdir(parents=True, exist_ok=True)
        record = template_record(name, ref, image, lazy,
                                 [self.store.size(hex_of(x.digest)) for x in image.layers])
        if credentials:
            # Kept (0600) so that evicted layers can be fetched again.
            self.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            secret = self.secrets_dir / f"{name}.json"
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"username": credentials.get("username", ""),
                           "password": credentials.get("password", "")}, f)
        tmp = directory / ".template.json.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, directory / "template.json")
        log.info("images: %s pulled as template %s (%s, %d layers, %s)", ref, name,
                 image.manifest_digest[:19], len(image.layers), "lazy" if lazy else "unpacked")
        return record

    # -- rootfs -------------------------------------------------------------------

    def ensure(self, template: Template) -> Path:
        """The template's rootfs, ready to boot from: evicted layers are fetched
        again from the image's source, then the layers are mounted."""
        info = template.image
        if info is None:
            return template.rootfs
        if self.on_use is not None:
            self.on_use(template.template_id)
        hexes = [hex_of(d) for d, _ in info.layers]
        lazy = self.is_lazy(info)
        with self._template_lock(info.manifest_digest):
            self._hold(hexes)
            try:
                missing = [(d, s) for d, s in info.layers if not self._have(hex_of(d), lazy)]
                cache_lookup("image", hit=not missing)
                if missing:
                    self._refetch(template, info, missing, lazy)
                if lazy and self.lazy is not None and os.path.ismount(template.rootfs) and \
                        not all(self.lazy.served(h) for h in hexes):
                    log.warning("images: a layer server of %s died; mounting its rootfs again",
                                template.template_id)
                    unmount(template.rootfs)
                if not os.path.ismount(template.rootfs):
                    lowers = hexes if not lazy or self.lazy is None else [
                        str(p) for p in self.lazy.mount_all(
                            hexes, self._saved_creds(template.template_id),
                            registry_origin(info.source))]
                    mount_layers(template.rootfs, self.store.layers_dir, lowers)
                    log.info("images: mounted rootfs of %s (%d layers)", template.template_id,
                             len(hexes))
                self.store.touch(hexes)
                self._make_room()
            finally:
                self._release(hexes)
        return template.rootfs

    def _refetch(self, template: Template, info: ImageInfo,
                 missing: list[tuple[str, int]], lazy: bool) -> None:
        log.info("images: fetching %d evicted layers of %s from %s", len(missing),
                 template.template_id, info.source)
        user, password = _creds(self._saved_creds(template.template_id))
        source = open_source(info.source, user, password)
        try:
            image = source.resolve()
            if image.manifest_digest != info.manifest_digest:
                log.info("images: %s now points at %s; fetching the pulled layers by digest",
                         info.source, image.manifest_digest[:19])
            by_digest = {x.digest: x for x in image.layers}
            layers = [by_digest.get(d) or Layer(d, s) for d, s in missing]
            self._fetch(source, Image(info.manifest_digest, layers, image.config),
                        info.source, lambda _: None, None, lazy)
        finally:
            source.close()

    # -- listing, deleting, eviction ---------------------------------------------------

    def list(self) -> list[dict]:
        out = []
        for t in self._image_templates():
            assert t.image is not None
            # Here now (no repository call: a listing of thousands of images stays local).
            lazy = self.is_lazy(t.image)
            cached = [self._here(hex_of(d), lazy) for d, _ in t.image.layers]
            out.append({
                "name": t.alias, "templateID": t.template_id, "image": t.image.source,
                "manifestDigest": t.image.manifest_digest, "createdAt": t.created_at,
                "layers": len(t.image.layers),
                "size": sum(s for _, s in t.image.layers),
                "cachedLayers": sum(cached), "mounted": os.path.ismount(t.rootfs),
                "loading": "lazy" if lazy else "unpack",
            })
        return out

    def usage(self) -> dict:
        return {"bytes": self.store.total(), "budget": self.store.budget,
                "layers": len(self.store.stored())}

    def delete(self, name: str) -> None:
        try:
            template = self.templates.get(name)
        except TemplateNotFound as exc:
            raise ImageNotFound(f"image template '{name}' not found") from exc
        info = template.image
        if info is None or template.snapshot_id or \
                not (self.templates.local_dir / template.template_id).is_dir():
            raise ImageInUse(f"template '{name}' is not a pulled image")
        if template.template_id in self.in_use():
            raise ImageInUse(f"template '{name}' is in use by sandboxes")
        with self._template_lock(info.manifest_digest):
            others = [t for t in self._image_templates() if t.template_id != template.template_id]
            shutil.rmtree(self.templates.local_dir / template.template_id, ignore_errors=True)
            (self.secrets_dir / f"{template.template_id}.json").unlink(missing_ok=True)
            still = {hex_of(d) for o in others if o.image for d, _ in o.image.layers}
            self._unmount_unused(template, others)
            for d, _ in info.layers:
                h = hex_of(d)
                if h not in still and self.store.has(h) and h not in self._busy:
                    self.store.remove(h)
        log.info("images: template %s deleted", name)

    def release(self, template: Template, also_used: Iterable[str] = ()) -> None:
        """A removed template's mounts: its rootfs and (lazily loaded) its layers'
        FUSE mounts go unless a template in use (``in_use``, pinned, ``also_used``:
        e.g. paused sandboxes') needs them. Another template sharing them that is not
        in use mounts them again on its next start. Costs O(templates in use)."""
        if template.image is None:
            return
        used = []
        for name in self.in_use() | self.pinned | set(also_used):
            try:
                used.append(self.templates.get(name))
            except TemplateNotFound:
                continue
        with self._template_lock(template.image.manifest_digest):
            self._unmount_unused(template, used)

    def _unmount_unused(self, template: Template, keep: builtins.list[Template]) -> None:
        """(Under the image's template lock.) ``keep``: templates whose mounts stay."""
        assert template.image is not None
        if os.path.ismount(template.rootfs) and not any(
                k.rootfs == template.rootfs for k in keep):
            unmount(template.rootfs)
        if self.lazy is None or not self.is_lazy(template.image):
            return
        with self._lock:
            still = {hex_of(d) for k in keep if k.image for d, _ in k.image.layers} | \
                set(self._busy)
        for d, _ in template.image.layers:
            if hex_of(d) not in still:
                self.lazy.unmount_idle(hex_of(d))

    def _protected(self) -> set[str]:
        """Layers of templates in use or pinned: each looked up by its name (a scan of
        every record is O(templates), and creates from images make thousands)."""
        out = {h for h, n in self._busy.items() if n > 0}
        for name in self.in_use() | self.pinned:
            try:
                t = self.templates.get(name)
            except TemplateNotFound:
                continue
            if t.image:
                out.update(hex_of(d) for d, _ in t.image.layers)
        return out

    def _make_room(self, need: int = 0) -> None:
        if self.room is not None:  # the node's one cache budget, layers and snapshots
            self.room(need)
            return
        with self._lock:
            if self.store.total() + need <= self.store.budget:
                return
            templates = self._image_templates()
            self.store.evict(self._protected(), lambda h: _unmount_users(templates, h), need)

    def evictable(self) -> builtins.list[tuple[float, str, int]]:
        """Layers an eviction may take now: (last use, sha256 hex, bytes)."""
        with self._lock:
            protected = self._protected()
            return [(float(m.get("used", 0)), h, int(m.get("size", 0)))
                    for h, m in self.store.stored().items() if h not in protected]

    def evict_layers(self, hexes: builtins.list[str]) -> int:
        """Remove these layers unless something came to need them; the bytes freed."""
        freed = 0
        with self._lock:
            templates = self._image_templates()
            protected = self._protected()
            for h in hexes:
                if h in protected or not self.store.has(h):
                    continue
                try:
                    _unmount_users(templates, h)
                except ImageError as exc:
                    log.warning("layer %s not evicted: %s", h[:12], exc)
                    continue
                freed += self.store.size(h)
                self.store.remove(h)
                log.info("layer store: evicted layer %s (LRU, over budget)", h[:12])
                EVICTIONS.labels("image_layer").inc()
        return freed

    def _image_templates(self) -> builtins.list[Template]:
        return [t for t in self.templates.list() if t.image is not None]

    def _hold(self, hexes: builtins.list[str]) -> None:
        with self._lock:
            for h in hexes:
                self._busy[h] = self._busy.get(h, 0) + 1

    def _release(self, hexes: builtins.list[str]) -> None:
        with self._lock:
            for h in hexes:
                self._busy[h] -= 1
                if self._busy[h] <= 0:
                    del self._busy[h]

    def template_lock(self, manifest_digest: str) -> threading.Lock:
        """Held while an image's rootfs is ensured or released."""
        with self._lock:
            return self._template_locks.setdefault(manifest_digest, threading.Lock())

    _template_lock = template_lock

    def forget_credentials(self, template_id: str) -> None:
        (self.secrets_dir / f"{template_id}.json").unlink(missing_ok=True)

    def _saved_creds(self, template_id: str) -> dict | None:
        try:
            return json.loads((self.secrets_dir / f"{template_id}.json").read_text())
        except (OSError, ValueError):
            return None


def _unmount_users(templates: builtins.list[Template], h: str) -> None:
    """A mount of an unused template still references the layer: drop it."""
    for t in templates:
        if t.image and any(hex_of(d) == h for d, _ in t.image.layers) and \
                os.path.ismount(t.rootfs):
            unmount(t.rootfs)
            if os.path.ismount(t.rootfs):
                raise ImageError(f"rootfs of {t.template_id} is still mounted")


def _creds(credentials: dict | None) -> tuple[str, str]:
    if not credentials:
        return "", ""
    if not isinstance(credentials, dict):
        raise BadReference("credentials must be an object with username and password")
    return str(credentials.get("username", "")), str(credentials.get("password", ""))
