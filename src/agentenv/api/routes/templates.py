"""Templates as the E2B SDKs and CLI see them: listing, aliases, and builds
(``POST /v3/templates``, context uploads, ``POST /v2/templates/{id}/builds/{id}``,
status with logs), and deletion."""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Query, Request, Response
from pydantic import Field
from starlette.types import ASGIApp, Receive, Scope, Send

from ...builds import (
    HASH,
    UPLOAD_URL_TTL,
    BuildError,
    TemplateBuilder,
    check_name_not_reserved,
    tagging,
)
from ...orchestrator import BadRequest, NotFound
from ...snapshot import SnapshotNotFound
from ...templates import Template, TemplateNotFound, TemplateRegistry
from ...templates.tags import MAX_TAGS, TAG_MAX_LENGTH
from .. import models

router = APIRouter()
# Context uploads carry a signed URL instead of the API key (the SDKs send them
# like uploads to object storage), and may exceed the API's body limit.
uploads = APIRouter()
UPLOAD_PATH = re.compile(r"^/templates/[^/]+/files/[0-9a-f]{64}/upload$")
JsonBody = Annotated[dict[str, Any], Body()]
MAX_PAGE = 100
LOG_PAGE = 100
LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


def _registry(request: Request) -> TemplateRegistry:
    return request.app.state.manager.templates


def _spawned(request: Request) -> dict[str, int]:
    """Running sandboxes per template ID (the node keeps no history of past ones)."""
    counts: dict[str, int] = {}
    for record in request.app.state.manager.list():
        counts[record.template_id] = counts.get(record.template_id, 0) + 1
    return counts


def _get(request: Request, name: str) -> Template:
    try:
        return _registry(request).get(name)
    except TemplateNotFound as exc:
        raise NotFound(str(exc)) from exc


@router.get("/templates", response_model=list[models.TemplateInfo],
            response_model_by_alias=True)
async def list_templates(request: Request, team_id: str | None = Query(default=None,
                                                                       alias="teamID")
                         ) -> list[models.TemplateInfo]:
    counts = _spawned(request)
    await asyncio.to_thread(_registry(request).sync)  # the cluster's other nodes' too
    return [models.template_info(t, counts.get(t.template_id, 0))
            for t in _registry(request).list()]


@router.get("/v2/templates", response_model=list[models.TemplateInfo],
            response_model_by_alias=True)
async def list_templates_v2(
    request: Request,
    response: Response,
    team_id: str | None = Query(default=None, alias="teamID"),
    limit: int | None = Query(default=None, ge=1, le=MAX_PAGE),
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[models.TemplateInfo]:
    """Templates by ID; ``x-next-token`` (the last ID handed out) when more remain."""
    limit = MAX_PAGE if limit is None else limit
    templates = sorted(_registry(request).list(), key=lambda t: t.template_id)
    if next_token:
        templates = [t for t in templates if t.template_id > next_token]
    chosen = templates[:limit]
    if len(templates) > limit:
        response.headers["x-next-token"] = chosen[-1].template_id
    counts = _spawned(request)
    return [models.template_info(t, counts.get(t.template_id, 0)) for t in chosen]


@router.get("/templates/aliases/{alias}", response_model=models.TemplateAlias,
            response_model_by_alias=True)
async def template_by_alias(alias: str, request: Request) -> models.TemplateAlias:
    for template in _registry(request).list():
        if alias in template.aliases or alias == template.template_id:
            return models.TemplateAlias(template_id=template.template_id)
    raise NotFound(f"template alias '{alias}' not found")


@router.get("/templates/{template_id}", response_model=models.TemplateWithBuilds,
            response_model_by_alias=True)
async def get_template(template_id: str, request: Request) -> models.TemplateWithBuilds:
    template = _get(request, template_id)
    return models.template_with_builds(template, _spawned(request).get(template.template_id, 0))


# -- tags (E2B's: a tag names one build; ``default`` is the current one) ----------------------

class AssignTags(models._Body):
    target: str = Field(min_length=1, max_length=256, description='"name:tag" of the build')
    tags: list[Annotated[str, Field(max_length=TAG_MAX_LENGTH + 8)]] = Field(
        max_length=MAX_TAGS)


class DeleteTags(models._Body):
    name: str = Field(min_length=1, max_length=256)
    tags: list[Annotated[str, Field(max_length=TAG_MAX_LENGTH + 8)]] = Field(
        max_length=MAX_TAGS)


@router.post("/templates/tags", status_code=201)
async def assign_template_tags(body: AssignTags, request: Request) -> dict:
    build, tags = await tagging.assign_tags(_builder(request), body.target, body.tags)
    return {"tags": tags, "buildID": models.template_build_id(build)}


@router.delete("/templates/tags", status_code=204)
async def delete_template_tags(body: DeleteTags, request: Request) -> Response:
    await tagging.remove_tags(_builder(request), body.name, body.tags)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags")
async def list_template_tags(template_id: str, request: Request) -> list[dict]:
    """The template's tags (a tag given with the name is ignored, as E2B does)."""
    template = _get(request, template_id.partition(":")[0])
    out = []
    for info in _registry(request).tag_list(template):
        created = info.created_at or models.template_info(template).created_at.isoformat()
        out.append({"tag": info.tag, "createdAt": created,
                    "buildID": models.build_uuid(template.template_id, info.build_id)})
    return out


# -- builds ---------------------------------------------------------------------------------

def _builder(request: Request) -> TemplateBuilder:
    return request.app.state.builder


@router.post("/v3/templates", status_code=202)
async def request_build(request: Request, body: models.TemplateBuildRequest) -> dict:
    """A build of template ``name``; cpuCount and memoryMB within the node's maximums
    (a 400 naming the field and the bound), a name no snapshot has (409)."""
    name = body.name or body.alias or ""
    builder = _builder(request)
    check_name_not_reserved(name)
    await builder.check_not_a_snapshot(name)
    build = builder.request(name, body.tags, body.cpu_count, body.memory_mb)
    return {"templateID": build.template_id, "buildID": build.build_id, "public": False,
            "names": build.names, "tags": build.tags, "aliases": build.names}


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def file_upload_link(template_id: str, files_hash: str, request: Request) -> dict:
    builder = _builder(request)
    if not builder.known_template(template_id):
        raise NotFound(f"template '{template_id}' not found")
    if builder.file_path(files_hash) is not None:
        return {"present": True}
    if not HASH.match(files_hash):
        raise BadRequest("files hash must be 64 lowercase hex digits")
    expires = int(time.time()) + UPLOAD_URL_TTL
    query = urlencode({"expires": expires,
                       "signature": builder.upload_token(template_id, files_hash, expires)})
    base = str(request.base_url).rstrip("/")
    return {"present": False,
            "url": f"{base}/templates/{template_id}/files/{files_hash}/upload?{query}"}


@uploads.put("/templates/{template_id}/files/{files_hash}/upload", status_code=201)
async def upload_file(template_id: str, files_hash: str, request: Request,
                      expires: str = "", signature: str = "") -> Response:
    builder = _builder(request)
    builder.check_upload(template_id, files_hash, expires, signature)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > builder.max_context_bytes:
        raise BuildError(builder.context_too_large(), 413)
    await builder.receive(files_hash, request.stream())
    return Response(status_code=201)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(template_id: str, build_id: str, request: Request,
                      body: JsonBody) -> Response:
    _builder(request).start_build(template_id, build_id, body)
    return Response(status_code=202)


def _get_build(request: Request, template_id: str, build_id: str):
    return _builder(request).build(template_id, build_id)


def _level_ok(entry: dict, level: str | None) -> bool:
    return level is None or LEVELS.get(entry.get("level", "info"), 1) >= LEVELS.get(level, 0)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(template_id: str, build_id: str, request: Request,
                       logs_offset: int = Query(default=0, alias="logsOffset", ge=0),
                       limit: int = Query(default=LOG_PAGE, ge=0, le=LOG_PAGE),
                       level: str | None = None) -> dict:
    build = _get_build(request, template_id, build_id)
    entries = _builder(request).logs(build_id)[logs_offset:logs_offset + limit]
    out = {"templateID": template_id, "buildID": build_id, "status": build.status,
           "logs": [], "logEntries": [e for e in entries if _level_ok(e, level)]}
    if build.reason:
        out["reason"] = build.reason
    return out


@router.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs(template_id: str, build_id: str, request: Request,
                     cursor: int | None = None,
                     limit: int = Query(default=LOG_PAGE, ge=0, le=LOG_PAGE),
                     direction: str = "forward", level: str | None = None) -> dict:
    """Entries after (forward) or before (backward) ``cursor``, a time in Unix ms."""
    _get_build(request, template_id, build_id)
    entries = [e for e in _builder(request).logs(build_id) if _level_ok(e, level)]
    if cursor is not None:
        entries = [e for e in entries if (_ms(e) >= cursor if direction == "forward"
                                          else _ms(e) <= cursor)]
    entries = entries[:limit] if direction == "forward" else entries[::-1][:limit]
    return {"logs": entries}


def _ms(entry: dict) -> int:
    return int(datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
               .timestamp() * 1000)


@router.delete("/templates/{template_id}/builds/{build_id}", status_code=204)
async def cancel_build(template_id: str, build_id: str, request: Request) -> Response:
    """Not in E2B's API: stops a build under way (it ends with status error)."""
    _get_build(request, template_id, build_id)
    await _builder(request).cancel(build_id)
    return Response(status_code=204)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_template(template_id: str, request: Request) -> Response:
    """A template, or a snapshot: E2B's snapshots are templates, and the SDKs'
    ``delete_snapshot`` is this route with the snapshot's ID or name."""
    try:
        await _builder(request).delete_template(template_id)
    except BuildError as exc:
        if exc.status != 404:
            raise
        try:
            await request.app.state.manager.delete_snapshot(template_id)
        except (NotFound, SnapshotNotFound):
            raise NotFound(f"template or snapshot '{template_id}' not found") from None
    return Response(status_code=204)


def unlimited_uploads(limited: ASGIApp, app: ASGIApp) -> ASGIApp:
    """Context uploads skip the API body limit (archives are large; they stream to disk)."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        target = app if scope["type"] == "http" and scope["method"] == "PUT" and \
            UPLOAD_PATH.match(scope["path"]) else limited
        await target(scope, receive, send)

    return route
