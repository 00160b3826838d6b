"""Templates published in the shared repository, so that every node of a cluster can
start any template: a node that lacks one fetches its metadata on first use.

Objects (beside the snapshots, in the same repository):
- ``templates/<templateID>.json``: the template's ``template.json`` as its node wrote
  it (a built template names its snapshot, already in this repository, and the
  rootfs it was built over; a pulled one its image's source and layers);
- ``template-aliases/<alias>``: the template ID an alias names.

The snapshot a built template restores is fetched like any other (peers first when
enabled, into the bounded node cache); a pulled image's layers from its source.
Everything here blocks (a repository call): callers in the event loop keep to
posix_fs or run it in a thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from .errors import ObjectMissing, SnapshotError
from .manifest import valid_name
from .repository import Repository

log = logging.getLogger(__name__)
TEMPLATES = "templates/"
ALIASES = "template-aliases/"
# How long a name no node published is remembered as such (a 404 storm stays local).
MISS_TTL_S = 2.0
MAX_DOC_BYTES = 1 << 20


class SharedTemplates:
    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self._misses: dict[str, float] = {}
        self._lock = threading.Lock()

    def publish(self, doc: dict[str, Any]) -> None:
        """Publish a template's metadata (its ID and aliases must be valid names)."""
        template_id = str(doc.get("templateID") or "")
        if not valid_name(template_id):
            raise ValueError(f"template ID {template_id!r} cannot be published")
        data = json.dumps(doc, indent=1).encode()
        if len(data) > MAX_DOC_BYTES:
            raise ValueError(f"template {template_id}: metadata over {MAX_DOC_BYTES} bytes")
        self.repo.put_object(TEMPLATES + f"{template_id}.json", data)
        for alias in doc.get("aliases") or []:
            if isinstance(alias, str) and alias != template_id and valid_name(alias):
                self.repo.put_object(ALIASES + alias, template_id.encode())
        with self._lock:
            self._misses.clear()

    def unpublish(self, template_id: str, aliases: tuple[str, ...] | list[str] = ()) -> None:
        if not valid_name(template_id):
            return
        for alias in aliases:
            if valid_name(alias) and self._get(ALIASES + alias) == template_id.encode():
                self.repo.delete_object(ALIASES + alias)
        self.repo.delete_object(TEMPLATES + f"{template_id}.json")

    def fetch(self, name: str) -> dict[str, Any] | None:
        """The published metadata of template ``name`` (an ID or an alias), or None."""
        if not valid_name(name):
            return None
        with self._lock:
            if self._misses.get(name, 0.0) > time.monotonic():
                return None
        try:
            data = self._get(TEMPLATES + f"{name}.json")
            if data is None:
                target = self._get(ALIASES + name)
                if target is not None and valid_name(target.decode(errors="replace")):
                    data = self._get(TEMPLATES + f"{target.decode()}.json")
        except SnapshotError as exc:
            log.warning("shared templates: cannot read %s from the repository: %s", name, exc)
            return None
        doc = _parse(data)
        if doc is None:
            with self._lock:
                self._misses[name] = time.monotonic() + MISS_TTL_S
                if len(self._misses) > 4096:  # bounded: the oldest misses go
                    for key in list(self._misses)[:2048]:
                        del self._misses[key]
        return doc

    def names(self) -> list[str]:
        """The IDs of every published template."""
        try:
            keys = self.repo.list_objects(TEMPLATES)
        except SnapshotError as exc:
            log.warning("shared templates: cannot list the repository: %s", exc)
            return []
        out = []
        for key in keys:
            name = key.rsplit("/", 1)[-1].removesuffix(".json")
            if key.endswith(".json") and valid_name(name):
                out.append(name)
        return sorted(out)

    def _get(self, key: str) -> bytes | None:
        try:
            return self.repo.get_object(key)
        except ObjectMissing:
            return None


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None or len(data) > MAX_DOC_BYTES:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not valid_name(str(doc.get("templateID") or "")):
        return None
    return doc
