"""Users' snapshots as E2B's API shows them: found by ID, name, or either with E2B's
``:default`` tag (E2B's snapshot IDs carry it); deleted only when nothing needs them;
their chunks collected after a delete.

A sandbox restored from a snapshot does not need it any more (its runtime holds
what it read, even once the files are unlinked), so such deletes go through. A
paused sandbox's own pause snapshot, a template build's snapshot and the node's
boot images are needed: deleting them is a 409 naming what holds them.
"""

from __future__ import annotations

import asyncio

from ..snapshot import Manifest, SnapshotError, SnapshotNotFound, SnapshotStore
from ..templates import TemplateRegistry
from ..templates.tags import DEFAULT_TAG, SEPARATOR
from .collect import SnapshotCollector
from .models import Conflict, NotFound, OrchestratorError


def _stem(name: str) -> str | None:
    """``x:default`` -> ``x`` (E2B's snapshot IDs carry the default tag)."""
    stem, sep, tag = name.rpartition(SEPARATOR)
    return stem if sep and stem and tag.lower() == DEFAULT_TAG else None


def resolve_snapshot(store: SnapshotStore, name: str) -> Manifest:
    """By ID or alias, either with E2B's ``:default`` tag; SnapshotNotFound else."""
    try:
        return store.resolve(name)
    except SnapshotNotFound:
        stem = _stem(name)
        if stem is None:
            raise
        return store.resolve(stem)


class UserSnapshots:
    def __init__(self, templates: TemplateRegistry, snapshots: SnapshotStore,
                 collector: SnapshotCollector) -> None:
        self.templates = templates
        self.snapshots = snapshots
        self.collector = collector

    def holder(self, manifest: Manifest) -> str | None:
        """What needs this snapshot (so it must stay), or None: a paused sandbox, a
        template build, or the node's boot image of a template."""
        meta = manifest.metadata
        sid = manifest.snapshot_id
        if meta.get("kind") == "pause":
            return (f"it is the saved state of paused sandbox "
                    f"'{meta.get('source_sandbox_id')}': resume it, or kill it (which "
                    "deletes it)")
        if meta.get("kind") == "template":
            return (f"it is this node's boot image of template '{meta.get('template_id')}' "
                    "(the node manages it)")
        for template in self.templates.list():
            if template.snapshot_id == sid:
                return (f"it is template '{template.alias}' as built: delete the template "
                        f"(DELETE /templates/{template.template_id})")
        return None

    async def delete(self, name: str) -> Manifest:
        """Delete a user's snapshot by ID or name (404 unknown, 409 needed), then
        collect its chunks in the background."""
        try:
            manifest = await asyncio.to_thread(resolve_snapshot, self.snapshots, name)
        except SnapshotNotFound as exc:
            raise NotFound(f"snapshot '{name}' not found") from exc
        holder = self.holder(manifest)
        if holder is not None:
            raise Conflict(f"snapshot '{name}' cannot be deleted: {holder}")
        try:
            await asyncio.to_thread(self.snapshots.delete, manifest.snapshot_id)
        except SnapshotNotFound as exc:  # deleted meanwhile
            raise NotFound(f"snapshot '{name}' not found") from exc
        self.collector.request()
        return manifest

    async def resolve(self, name: str, missing: str, cause: BaseException | None = None
                      ) -> Manifest:
        """The snapshot ``name`` names; NotFound with ``missing`` if none."""
        try:
            return await asyncio.to_thread(resolve_snapshot, self.snapshots, name)
        except SnapshotNotFound as exc:
            raise NotFound(missing) from (cause or exc)
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc


__all__ = ["UserSnapshots", "resolve_snapshot"]
