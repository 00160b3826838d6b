"""Finds templates on disk: ``<dir>/<id>/template.json`` (plus ``rootfs/`` for built-in ones).

Two directories are searched: the built-in templates made at set-up (shared,
read-only to the node) and the node's own, which pulls and builds write.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..resources import CPU, DISK, MEMORY, ResourceLimits
from .tags import DEFAULT_TAG, InvalidTag, TagInfo, TemplateTags, split_ref

BUILDS_DIR = "builds"  # <template dir>/builds/<buildID>.json: each kept build's metadata
# In a template's directory: it was fetched from the cluster's shared repository
# (its mtime: when; a copy older than SHARED_REFRESH_S is read again on use, so a
# rebuild on another node reaches this one).
SHARED_MARK = ".shared"
SHARED_REFRESH_S = 10.0
# In a template's directory: one empty file per user snapshot taken of its sandboxes.
SNAPSHOTS_DIR = ".snapshots"
log = logging.getLogger(__name__)


class RemoteTemplates(Protocol):
    """Where a cluster's nodes publish their templates' metadata (the shared
    repository): a node fetches a template it lacks on first use."""

    def publish(self, doc: dict[str, Any]) -> None: ...

    def unpublish(self, template_id: str, aliases: tuple[str, ...]) -> None: ...

    def fetch(self, name: str) -> dict[str, Any] | None: ...

    def names(self) -> builtins.list[str]: ...


class TemplateNotFound(LookupError):
    pass


class InvalidTemplateRef(TemplateNotFound):
    """A ``name:tag`` whose tag breaks the rule (a 400 where nothing else matches)."""


@dataclass(frozen=True)
class ImageInfo:
    """A template pulled from an OCI image: its rootfs is the image's layers, mounted
    by ``agentenv.images`` on demand (the layers may be fetched again from ``source``)."""

    source: str  # the reference pulled: registry ref, oci-layout:DIR[:tag], docker-archive:F
    manifest_digest: str
    layers: tuple[tuple[str, int], ...]  # (digest, blob size), bottom layer first
    env: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    # How its layers are loaded: "lazy" or "unpack", chosen at its pull; "" in records
    # from before the choice was kept (the node's image_loading then says).
    loading: str = ""

    @classmethod
    def from_json(cls, doc: dict) -> ImageInfo:
        cfg = doc.get("config") or {}
        loading = doc.get("loading")
        return cls(
            source=str(doc["source"]), manifest_digest=str(doc["manifestDigest"]),
            layers=tuple((str(x["digest"]), int(x["size"])) for x in doc["layers"]),
            env=tuple(cfg.get("env") or ()), cmd=tuple(cfg.get("cmd") or ()),
            workdir=cfg.get("workdir") or "", user=cfg.get("user") or "",
            loading=loading if loading in ("lazy", "unpack") else "",
        )


@dataclass(frozen=True)
class Template:
    template_id: str
    rootfs: Path
    cpu_count: int = 2
    memory_mb: int = 512
    disk_size_mb: int = 0
    aliases: tuple[str, ...] = field(default_factory=tuple)
    created_at: str = ""
    build_id: str = ""
    # Run in the background as root when a sandbox starts; the create returns
    # once ready_cmd exits 0 (both optional).
    start_cmd: str = ""
    ready_cmd: str = ""
    ready_timeout_s: float = 60.0
    # A built template is a snapshot (taken with its start command running) over
    # the rootfs its build started from; sandboxes restore it instead of booting.
    snapshot_id: str = ""
    envs: tuple[tuple[str, str], ...] = ()
    default_user: str = ""
    default_workdir: str = ""
    # envd's file operations for this template's sandboxes: "root" or "user" (see
    # Config.envd_file_access, the default when empty).
    file_access: str = ""
    # Set for a template pulled from an image (rootfs is then its mount point).
    image: ImageInfo | None = None

    @property
    def alias(self) -> str:
        return self.aliases[0] if self.aliases else self.template_id


class TemplateRegistry:
    def __init__(self, templates_dir: Path, local_dir: Path | None = None,
                 rootfs_dir: Path | None = None):
        self.templates_dir = templates_dir
        # Where this node writes the templates it pulls or builds.
        self.local_dir = local_dir or templates_dir
        # Where image templates' layers are mounted (one directory per image).
        self.rootfs_dir = rootfs_dir or self.local_dir / ".rootfs"
        # The node's resource bounds: a template.json asking for more is clamped.
        self.limits: ResourceLimits | None = None
        # Tags other than ``default`` (which is each template's current build).
        self.tags = TemplateTags(self.local_dir / ".tags")
        # A cluster node's shared templates (None on a node of its own).
        self.remote: RemoteTemplates | None = None

    @property
    def dirs(self) -> list[Path]:
        return [self.templates_dir] if self.local_dir == self.templates_dir else \
            [self.templates_dir, self.local_dir]

    def list(self) -> list[Template]:
        found: dict[str, Template] = {}
        for directory in self.dirs:
            if not directory.is_dir():
                continue
            for meta in sorted(directory.glob("*/template.json")):
                template = self._load(meta.parent)
                if template is not None:
                    found.setdefault(template.template_id, template)
        return list(found.values())

    def get(self, name: str) -> Template:
        """By template ID or alias, either with a ``:tag`` (the build that tag names;
        none or ``default``: the current build); raises TemplateNotFound."""
        try:
            base, tag = split_ref(name)
        except InvalidTag as exc:
            raise InvalidTemplateRef(f"template '{name[:200]}': {exc}") from None
        template = self._get(base)
        if tag is None or tag == DEFAULT_TAG:
            return template
        info = self.tags.read(template.template_id).get(tag)
        if info is None:
            raise TemplateNotFound(f"template '{base}' has no tag '{tag}'")
        if info.build_id == template.build_id:
            return template
        built = self.load_build(template.template_id, info.build_id)
        if built is None:
            raise TemplateNotFound(f"template '{base}': the build of tag '{tag}' is gone")
        return built

    def tag_list(self, template: Template) -> builtins.list[TagInfo]:
        """``default`` (the current build) first, then the others by name."""
        default = TagInfo(DEFAULT_TAG, template.build_id, template.created_at)
        others = self.tags.read(template.template_id)
        others.pop(DEFAULT_TAG, None)
        return [default, *sorted(others.values(), key=lambda t: t.tag)]

    def build_path(self, template_id: str, build_id: str) -> Path:
        return self.local_dir / template_id / BUILDS_DIR / f"{build_id}.json"

    def load_build(self, template_id: str, build_id: str) -> Template | None:
        """A kept build of a template this node built (None if not kept)."""
        if not build_id or "/" in build_id or build_id.startswith("."):
            return None
        return self._load(self.local_dir / template_id, self.build_path(template_id, build_id))

    def _get(self, name: str) -> Template:
        template = self._get_local(name)
        if template is not None and self._stale(template.template_id):
            self._fetch(template.template_id)
            template = self._get_local(name)
        elif template is None and self._fetch(name):
            template = self._get_local(name)
        if template is None:
            raise TemplateNotFound(f"template '{name}' not found")
        return template

    def _get_local(self, name: str) -> Template | None:
        if name and "/" not in name and not name.startswith("."):
            for directory in self.dirs:
                template = self._load(directory / name)
                if template is not None:
                    return template
        for template in self.list():
            if name in template.aliases:
                return template
        return None

    # -- users' snapshots of a template (they restore over its rootfs) ------------------

    def note_snapshot(self, template_id: str, snapshot_id: str) -> None:
        """Remember that a snapshot was taken of a sandbox of this node's template: an
        automatic clean-up keeps the template while the snapshot exists."""
        directory = self.local_dir / template_id
        if not _plain(template_id) or not _plain(snapshot_id) or \
                not (directory / "template.json").exists():
            return
        (directory / SNAPSHOTS_DIR).mkdir(exist_ok=True)
        (directory / SNAPSHOTS_DIR / snapshot_id).touch()

    def snapshots_of(self, template_id: str) -> builtins.list[str]:
        """Snapshots noted for the template (some may have been deleted since)."""
        directory = self.local_dir / template_id / SNAPSHOTS_DIR
        if not _plain(template_id) or not directory.is_dir():
            return []
        return sorted(p.name for p in directory.iterdir())

    def forget_snapshot(self, template_id: str, snapshot_id: str) -> None:
        if _plain(template_id) and _plain(snapshot_id):
            (self.local_dir / template_id / SNAPSHOTS_DIR / snapshot_id).unlink(missing_ok=True)

    # -- the cluster's shared templates -------------------------------------------------

    def publish(self, template_id: str) -> None:
        """Publish a template this node wrote (built, pulled, retagged) for the other
        nodes; one fetched from the repository is not published back."""
        directory = self.local_dir / template_id
        if self.remote is None or (directory / SHARED_MARK).exists():
            return
        try:
            self.remote.publish(json.loads((directory / "template.json").read_text()))
        except (OSError, ValueError) as exc:  # the node keeps it; the others cannot start it
            log.warning("template %s not published to the cluster: %s", template_id, exc)

    def unpublish(self, template: Template) -> None:
        if self.remote is not None:
            try:
                self.remote.unpublish(template.template_id, template.aliases)
            except (OSError, ValueError) as exc:
                log.warning("template %s not unpublished: %s", template.template_id, exc)

    def sync(self) -> None:
        """Fetch every published template this node lacks (a listing shows them)."""
        if self.remote is None:
            return
        local = {t.template_id for t in self.list()}
        for name in self.remote.names():
            if name not in local:
                self._fetch(name)

    def _stale(self, template_id: str) -> bool:
        mark = self.local_dir / template_id / SHARED_MARK
        try:
            return self.remote is not None and \
                time.time() - mark.stat().st_mtime > SHARED_REFRESH_S
        except OSError:
            return False  # not a shared copy

    def _fetch(self, name: str) -> bool:
        """Fetch template ``name`` (an ID or an alias) from the cluster's repository
        into this node's templates; True if it is here now."""
        if self.remote is None or not name or "/" in name or name.startswith("."):
            return False
        doc = self.remote.fetch(name)
        mark = self.local_dir / name / SHARED_MARK
        if doc is None:
            if mark.exists():  # unreachable or unpublished: the copy stands a while more
                mark.touch()
            return False
        template_id = str(doc["templateID"])
        directory = self.local_dir / template_id
        if (directory / "template.json").exists() and not (directory / SHARED_MARK).exists():
            return True  # this node's own wins over what the repository says
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SHARED_MARK).touch()
        tmp = directory / f".template.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, directory / "template.json")
        log.info("template %s fetched from the cluster's repository", template_id)
        return self._load(directory) is not None

    def _resource(self, name: str, value, default: int) -> int:
        """A template's resource as its file says, within the node's bounds (a file
        on disk is not trusted with a sandbox's limits)."""
        if self.limits is not None:
            return self.limits.clamp(name, value, default)
        try:
            return int(value) if value is not None else default
        except (TypeError, ValueError, OverflowError):
            return default

    def _load(self, directory: Path, meta_path: Path | None = None) -> Template | None:
        try:
            meta = json.loads((meta_path or directory / "template.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        rootfs = directory / "rootfs"
        if meta.get("snapshotID") and meta.get("rootfs"):
            rootfs = Path(meta["rootfs"])
        image = None
        if isinstance(meta.get("image"), dict):
            try:
                image = ImageInfo.from_json(meta["image"])
            except (KeyError, TypeError, ValueError):
                return None
            # Mounted on demand (agentenv.images ensures it before a sandbox starts).
            rootfs = self.rootfs_dir / image.manifest_digest.split(":")[-1][:16]
        elif not rootfs.is_dir():
            return None
        return Template(
            template_id=meta.get("templateID", directory.name),
            rootfs=rootfs,
            cpu_count=self._resource(CPU, meta.get("cpuCount"), 2),
            memory_mb=self._resource(MEMORY, meta.get("memoryMB"), 512),
            disk_size_mb=self._resource(DISK, meta.get("diskSizeMB"), 0),
            aliases=tuple(meta.get("aliases", [])),
            created_at=meta.get("createdAt", ""),
            build_id=meta.get("buildID", ""),
            start_cmd=meta.get("startCmd", ""),
            ready_cmd=meta.get("readyCmd", ""),
            ready_timeout_s=float(meta.get("readyTimeoutSec", 60)),
            snapshot_id=meta.get("snapshotID", ""),
            envs=tuple(sorted((str(k), str(v)) for k, v in meta.get("envs", {}).items())),
            default_user=meta.get("defaultUser", ""),
            default_workdir=meta.get("defaultWorkdir", ""),
            file_access=_file_access(meta.get("fileAccess")),
            image=image,
        )


def _file_access(value) -> str:
    """A template.json's "fileAccess" ("root" or "user"); anything else: the node's."""
    return value if value in ("root", "user") else ""


def _plain(name: str) -> bool:
    """A name usable as one path component."""
    return bool(name) and "/" not in name and not name.startswith(".") and "\0" not in name
