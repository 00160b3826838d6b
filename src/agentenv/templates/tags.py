"""E2B's ``name:tag`` references: a tag names one build of a template.

A name without a tag means the ``default`` tag, which every build takes unless it
names its own tags (E2B's rule). Tags are E2B's charset (lowercase letters, digits,
'.', '_' and '-', given in any case and trimmed, as E2B normalises them), here also
bounded in length and starting with a letter or digit, and never a UUID (E2B's rule:
a UUID reads as a build ID).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

DEFAULT_TAG = "default"
SEPARATOR = ":"
TAG_MAX_LENGTH = 64
TAG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
TAG_RULE = ("1-64 characters of a-z, 0-9, '.', '_' and '-', starting with a letter or "
            "digit, not a UUID")
MAX_TAGS = 32  # per template: each keeps a build (and its snapshot) alive
_TAG = re.compile(TAG_PATTERN)


class InvalidTag(ValueError):
    pass


def normalize_tag(tag: str) -> str:
    """The tag as stored (trimmed, lowercase); InvalidTag says the rule."""
    if not isinstance(tag, str):
        raise InvalidTag(f"invalid tag {tag!r}: use {TAG_RULE}")
    clean = tag.strip().lower()
    if not _TAG.fullmatch(clean):
        raise InvalidTag(f"invalid tag {tag[:80]!r}: use {TAG_RULE}")
    try:
        uuid.UUID(clean)
    except ValueError:
        return clean
    raise InvalidTag(f"invalid tag {tag!r}: a tag cannot be a UUID")


def normalize_tags(tags: list[str]) -> list[str]:
    """Each tag normalised, duplicates dropped, order kept; at least one."""
    if not isinstance(tags, list) or not tags:
        raise InvalidTag("at least one tag is required")
    if len(tags) > MAX_TAGS:
        raise InvalidTag(f"at most {MAX_TAGS} tags at once")
    return list(dict.fromkeys(normalize_tag(t) for t in tags))


def split_ref(ref: str) -> tuple[str, str | None]:
    """``name:tag`` -> (name, tag); (name, None) when no tag is given. The tag is
    checked (InvalidTag); the name is the caller's to look up."""
    name, sep, tag = ref.partition(SEPARATOR)
    return name.strip(), normalize_tag(tag) if sep else None


@dataclass(frozen=True)
class TagInfo:
    tag: str
    build_id: str
    created_at: str  # RFC 3339, UTC


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class TemplateTags:
    """The tags of each template but ``default``: ``<dir>/<templateID>.json``, tag ->
    build, replaced atomically. ``default`` is implicit: the template's current build
    (its ``template.json``), so a template never lacks it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._lock = threading.Lock()

    def _path(self, template_id: str) -> Path:
        if not template_id or "/" in template_id or template_id.startswith("."):
            raise InvalidTag(f"invalid template ID {template_id!r}")
        return self.dir / f"{template_id}.json"

    def read(self, template_id: str) -> dict[str, TagInfo]:
        try:
            doc = json.loads(self._path(template_id).read_text())
        except (OSError, ValueError):
            return {}
        out = {}
        for tag, info in (doc.get("tags") or {}).items() if isinstance(doc, dict) else ():
            with contextlib.suppress(AttributeError, KeyError, TypeError):
                out[str(tag)] = TagInfo(str(tag), str(info["buildID"]),
                                        str(info.get("createdAt", "")))
        return out

    def _write(self, template_id: str, tags: dict[str, TagInfo]) -> None:
        path = self._path(template_id)
        if not tags:
            path.unlink(missing_ok=True)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {"tags": {t.tag: {"buildID": t.build_id, "createdAt": t.created_at}
                        for t in sorted(tags.values(), key=lambda t: t.tag)}}
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def assign(self, template_id: str, build_id: str, tags: list[str]) -> None:
        """Point ``tags`` (not ``default``) at ``build_id``, moving them from any other
        build; InvalidTag past MAX_TAGS."""
        with self._lock:
            current = self.read(template_id)
            now = _now()
            for tag in tags:
                if tag != DEFAULT_TAG:
                    current[tag] = TagInfo(tag, build_id, now)
            if len(current) + 1 > MAX_TAGS:
                raise InvalidTag(f"a template has at most {MAX_TAGS} tags (with "
                                 f"'{DEFAULT_TAG}'); remove some first")
            self._write(template_id, current)

    def remove(self, template_id: str, tags: list[str]) -> None:
        with self._lock:
            current = self.read(template_id)
            for tag in tags:
                current.pop(tag, None)
            self._write(template_id, current)

    def drop(self, template_id: str) -> None:
        """The template is gone: so are its tags."""
        with self._lock:
            self._path(template_id).unlink(missing_ok=True)
