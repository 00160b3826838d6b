"""Template tags as E2B's API moves them: ``POST /templates/tags`` points tags at the
build a ``name:tag`` names, ``DELETE /templates/tags`` removes them (never
``default``). Moving ``default`` to another kept build makes that build the
template's current one; builds no tag names any more lose their snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ..templates import Template, TemplateNotFound
from ..templates.tags import DEFAULT_TAG, InvalidTag, normalize_tags, split_ref
from .errors import BuildError

# The TemplateBuilder (not imported: it imports this module).
TemplateBuilder = Any


def _template(builder: TemplateBuilder, name: str) -> Template:
    try:
        return builder.registry.get(name)
    except TemplateNotFound as exc:
        raise BuildError(str(exc), 404) from exc


async def assign_tags(builder: TemplateBuilder, target: str,
                      tags: list[str]) -> tuple[Template, list[str]]:
    """Point ``tags`` at the build ``target`` (``name:tag``, no tag: ``default``)
    names; returns that build and the tags as stored."""
    try:
        name, tag = split_ref(target)
        wanted = normalize_tags(tags)
    except InvalidTag as exc:
        raise BuildError(str(exc)) from exc
    current = _template(builder, name)
    build = _template(builder, f"{current.template_id}:{tag or DEFAULT_TAG}")
    registry = builder.registry
    async with builder._publish_lock:
        if DEFAULT_TAG in wanted and build.build_id != current.build_id:
            # (only a template this node built keeps its builds' metadata)
            path = registry.build_path(current.template_id, build.build_id)
            try:
                meta = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise BuildError(f"build '{build.build_id}' cannot become the default of "
                                 f"template '{name}': {exc}", 409) from exc
            write_json(registry.local_dir / current.template_id / "template.json", meta)
        try:
            registry.tags.assign(current.template_id, build.build_id,
                                 [t for t in wanted if t != DEFAULT_TAG])
        except InvalidTag as exc:
            raise BuildError(str(exc)) from exc
        stale = builder._unreferenced(current.template_id, current)
    await asyncio.to_thread(registry.publish, current.template_id)
    for snapshot_id in stale:
        await builder._delete_snapshot(snapshot_id)
    return build, wanted


async def remove_tags(builder: TemplateBuilder, name: str, tags: list[str]) -> None:
    """Remove tags (E2B: never ``default``, and ``name`` without a tag); a build no
    tag names any more goes with its snapshot."""
    try:
        wanted = normalize_tags(tags)
        base, tag = split_ref(name)
    except InvalidTag as exc:
        raise BuildError(str(exc)) from exc
    if tag is not None:
        raise BuildError("the template name must not carry a tag: name the tags in 'tags'")
    if DEFAULT_TAG in wanted:
        raise BuildError(f"the '{DEFAULT_TAG}' tag cannot be removed")
    template = _template(builder, base)
    async with builder._publish_lock:
        builder.registry.tags.remove(template.template_id, wanted)
        stale = builder._unreferenced(template.template_id, None)
    for snapshot_id in stale:
        await builder._delete_snapshot(snapshot_id)


def write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
