"""Finds templates on disk: ``<dir>/<id>/template.json`` (plus ``rootfs/`` for built-in ones).

Two directories are searched: the built-in templates made at set-up (shared,
read-only to the node) and the node's own, which pulls and builds write.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..resources import CPU, DISK, MEMORY, ResourceLimits
from .tags import DEFAULT_TAG, InvalidTag, TagInfo, TemplateTags, split_ref

BUILDS_DIR = "builds"  # <template dir>/builds/<buildID>.json: each kept build's metadata


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

    @classmethod
    def from_json(cls, doc: dict) -> ImageInfo:
        cfg = doc.get("config") or {}
        return cls(
            source=str(doc["source"]), manifest_digest=str(doc["manifestDigest"]),
            layers=tuple((str(x["digest"]), int(x["size"])) for x in doc["layers"]),
            env=tuple(cfg.get("env") or ()), cmd=tuple(cfg.get("cmd") or ()),
            workdir=cfg.get("workdir") or "", user=cfg.get("user") or "",
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
        if name and "/" not in name and not name.startswith("."):
            for directory in self.dirs:
                template = self._load(directory / name)
                if template is not None:
                    return template
        for template in self.list():
            if name in template.aliases:
                return template
        raise TemplateNotFound(f"template '{name}' not found")

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
            image=image,
        )
