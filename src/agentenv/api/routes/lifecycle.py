"""Routes that branch, freeze and rewind sandboxes: fork, pause/resume, snapshots, reset."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from ...orchestrator import BadRequest, Conflict, SandboxManager
from ...orchestrator.requests import MAX_FORK
from ...orchestrator.snapshots import resolve_snapshot
from ...snapshot import SnapshotError
from ...snapshot.manifest import NAME_MAX_LENGTH, NAME_PATTERN, check_name
from ...templates import TemplateNotFound
from ...templates.tags import DEFAULT_TAG
from ...web.keys import caller
from .. import models

router = APIRouter()
MAX_PAGE = 100


class ForkRequest(models._Body):
    count: int = Field(default=1, ge=1, le=MAX_FORK, description="Children to create, 1..16")
    timeout: int | None = Field(default=None, ge=0,
                                description="Children's time to live in seconds")


def _manager(request: Request) -> SandboxManager:
    return request.app.state.manager


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201,
             response_model=list[models.ChildResult], response_model_by_alias=True,
             response_model_exclude_none=True, responses=models.NDJSON_RESPONSES)
async def fork_sandbox(sandbox_id: str, body: ForkRequest, request: Request
                       ) -> list[models.ChildResult] | StreamingResponse:
    """Branch a running sandbox into children that continue its memory, processes and files.

    One result per child, in the order they came up. Asked for NDJSON, each is sent
    as soon as its child is up, so a client can use the first children while the
    others are still being restored."""
    children = _manager(request).fork_each(sandbox_id, body.count, body.timeout,
                                          caller(request))
    return await models.children_answer(children, request)


class ResumeRequest(models._Body):
    timeout: int | None = Field(default=None, ge=0)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    # False: boot from the paused sandbox's files alone (E2B's disk-only resume).
    memory: bool = True


class PauseRequest(models._Body):
    # False: keep the files only; a resume then reboots the sandbox with them.
    memory: bool = True


class SnapshotRequest(models._Body):
    # The snapshot store's own rule (documented as its pattern); its message is the 400's.
    name: str | None = Field(default=None, min_length=1, max_length=NAME_MAX_LENGTH,
                             json_schema_extra={"pattern": NAME_PATTERN})
    # False: the files only; sandboxes made from it boot with them.
    memory: bool = True

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str | None) -> str | None:
        if name is not None:
            try:
                check_name("snapshot name", name)
            except SnapshotError as exc:
                raise ValueError(str(exc)) from None
        return name


class ResetRequest(models._Body):
    # A snapshot ID or name; none: the last snapshot taken of this sandbox.
    snapshot_id: str | None = Field(default=None, alias="snapshotID", min_length=1,
                                    max_length=NAME_MAX_LENGTH)
    # Seconds to live from now; none: a running sandbox keeps its expiry.
    timeout: int | None = Field(default=None, ge=0)
    # memory: the snapshot restored whole. filesystem: for tasks whose state is their
    # files, the files reset in place with no restore once the sandbox has been reset
    # to this snapshot before (docs/api.md); the answer's mode says which it took.
    mode: Literal["memory", "filesystem"] = "memory"

    @field_validator("snapshot_id")
    @classmethod
    def _valid_ref(cls, ref: str | None) -> str | None:
        if ref is not None:
            try:
                check_name("snapshot ID or name", ref)
            except SnapshotError as exc:
                raise ValueError(str(exc)) from None
        return ref


class SandboxReset(models.SandboxCreated):
    snapshot_id: str = Field(serialization_alias="snapshotID")
    end_at: datetime = Field(serialization_alias="endAt")
    # What the reset did: "memory" (a restore) or "filesystem" (the files layer).
    mode: str


class SnapshotInfo(models._Body):
    snapshot_id: str = Field(serialization_alias="snapshotID")
    names: list[str] = Field(default_factory=list)
    sandbox_id: str | None = Field(default=None, serialization_alias="sandboxID")
    template_id: str | None = Field(default=None, serialization_alias="templateID")
    created_at: float | None = Field(default=None, serialization_alias="createdAt")
    total_bytes: int | None = Field(default=None, serialization_alias="totalBytes")
    stored_bytes: int | None = Field(default=None, serialization_alias="storedBytes")


def _info(manifest) -> SnapshotInfo:
    meta = manifest.metadata
    return SnapshotInfo(
        snapshot_id=manifest.snapshot_id, names=[manifest.alias] if manifest.alias else [],
        sandbox_id=meta.get("source_sandbox_id"), template_id=meta.get("template_id"),
        created_at=manifest.created_at, total_bytes=manifest.total_bytes,
        stored_bytes=manifest.stored_bytes,
    )


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(sandbox_id: str, request: Request,
                        body: PauseRequest | None = None) -> Response:
    """Save the sandbox's memory, processes and files (``memory: false``: its files
    only). A memory pause answers once the sandbox is frozen; it stays in memory
    (a resume is a thaw) until evicted."""
    await _manager(request).pause(sandbox_id, memory=body.memory if body else True)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/evict", status_code=204)
async def evict_sandbox(sandbox_id: str, request: Request) -> Response:
    """agentenv's extension: free a paused sandbox's memory and slot now (once its
    capture is made) instead of at its idle time; a resume then restores it."""
    await _manager(request).evict(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201,
             response_model=models.SandboxCreated, response_model_by_alias=True,
             response_model_exclude_none=True)
async def resume_sandbox(sandbox_id: str, request: Request,
                         body: ResumeRequest | None = None) -> models.SandboxCreated:
    body = body or ResumeRequest()
    record = await _manager(request).resume(sandbox_id, body.timeout, body.auto_pause,
                                            memory=body.memory)
    return models.created(record, request.app.state.config.domain)


@router.post("/sandboxes/{sandbox_id}/reset", response_model=SandboxReset,
             response_model_by_alias=True, response_model_exclude_none=True)
async def reset_sandbox(sandbox_id: str, request: Request,
                        body: ResetRequest | None = None) -> SandboxReset:
    """agentenv extension (E2B has none): bring a running or paused sandbox back to a
    snapshot's memory, processes and files, keeping its ID, envd access token and
    traffic token. Without ``snapshotID``: the last snapshot taken of it. ``mode:
    filesystem`` resets a task whose state is its files in place, in milliseconds,
    from its second reset to the snapshot on."""
    body = body or ResetRequest()
    record, manifest, mode = await _manager(request).reset(
        sandbox_id, body.snapshot_id, body.timeout, body.mode)
    created = models.created(record, request.app.state.config.domain)
    return SandboxReset(**created.model_dump(), snapshot_id=manifest.snapshot_id,
                        end_at=datetime.fromtimestamp(record.end_at, tz=UTC), mode=mode)


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo,
             response_model_by_alias=True, response_model_exclude_none=True)
async def snapshot_sandbox(sandbox_id: str, request: Request,
                           body: SnapshotRequest | None = None) -> SnapshotInfo:
    """Capture a running sandbox; it is stopped only for the capture."""
    name = body.name if body else None
    if name:
        _check_not_a_template(request, name)
    manifest = await _manager(request).snapshot(
        sandbox_id, name, memory=body.memory if body else True)
    return _info(manifest)


@router.get("/snapshots", response_model=list[SnapshotInfo], response_model_by_alias=True,
            response_model_exclude_none=True)
async def list_snapshots(
    request: Request, response: Response,
    sandbox_id: str | None = Query(None, alias="sandboxID"),
    name: str | None = None,
    limit: int = Query(default=MAX_PAGE, ge=1, le=MAX_PAGE),
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[SnapshotInfo]:
    """Users' snapshots, newest first (as E2B lists them), a page at a time."""
    mgr = _manager(request)
    manifests = await asyncio.to_thread(mgr.snapshots.list, sandbox_id)
    # Pause snapshots, boot images and template builds are needed by what holds them.
    chosen = [m for m in manifests if mgr.user_snapshot_holder(m) is None]
    if name is not None:
        chosen = [m for m in chosen if _named(m, name)]
    chosen.sort(key=_page_key, reverse=True)
    if next_token:
        cursor = _decode_cursor(next_token)
        chosen = [m for m in chosen if _page_key(m) < cursor]
    if len(chosen) > limit:
        response.headers["x-next-token"] = _encode_cursor(chosen[limit - 1])
    return [_info(m) for m in chosen[:limit]]


def _named(manifest, name: str) -> bool:
    """E2B's filter: the name or ID, either possibly with the ``:default`` tag."""
    wanted = {name}
    stem, sep, tag = name.rpartition(":")
    if sep and tag.lower() == DEFAULT_TAG:
        wanted.add(stem)
    return manifest.snapshot_id in wanted or manifest.alias in wanted


def _page_key(manifest) -> tuple[float, str]:
    return (manifest.created_at, manifest.snapshot_id)


def _encode_cursor(manifest) -> str:
    raw = json.dumps(list(_page_key(manifest)), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: str) -> tuple[float, str]:
    try:
        created, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return float(created), str(sid)
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("invalid nextToken") from None


@router.get("/snapshots/{snapshot_id}", response_model=SnapshotInfo,
            response_model_by_alias=True, response_model_exclude_none=True)
async def get_snapshot(snapshot_id: str, request: Request) -> SnapshotInfo:
    store = _manager(request).snapshots
    return _info(await asyncio.to_thread(resolve_snapshot, store, snapshot_id))


@router.get("/snapshots/{snapshot_id}/lineage")
async def snapshot_lineage(snapshot_id: str, request: Request) -> dict:
    """Where a snapshot came from (``ancestors``: template, sandboxes, snapshots, from
    the root down) and everything made from it since (``tree``: sandboxes created
    from it or reset to it, their forks, their snapshots). Sandboxes are this node's;
    one that is gone shows as ``gone``."""
    return await _manager(request).lineage(snapshot_id)


@router.post("/snapshots/{before}/diff/{after}")
@router.get("/snapshots/{before}/diff/{after}")
async def snapshot_diff(before: str, after: str, request: Request,
                        text: bool = Query(default=False, description="Unified diffs of "
                                           "changed text files (small ones, up to 50)")
                        ) -> dict:
    """Files added, removed and changed from ``before`` to ``after``: each a snapshot
    (ID or name) or a running sandbox of this node. A snapshot is restored for the
    purpose into a sandbox without network that is killed afterwards: that takes a
    POST; a GET compares running sandboxes only (it creates nothing; a 405 naming POST
    otherwise), so a console session's GET cannot start sandboxes. At most one diff
    per API key and two per node run at once (429), and text diffs are bounded in
    lines and time (413)."""
    owner = caller(request)
    return await _manager(request).diff(
        before, after, text, owner, may_restore=request.method == "POST")


@router.get("/lineage")
async def all_lineage(request: Request) -> dict:
    """Every lineage tree: templates at the roots, then sandboxes and their snapshots."""
    return await _manager(request).lineage()


@router.delete("/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, request: Request) -> Response:
    """A user's snapshot (by ID or name); 409 while a paused sandbox or a template needs it."""
    await _manager(request).delete_snapshot(snapshot_id)
    return Response(status_code=204)


def _check_not_a_template(request: Request, name: str) -> None:
    """A create names a template before a snapshot: a snapshot named like a template
    (or like one whose first build is under way) could never be reached by name."""
    try:
        template = _manager(request).templates.get(name)
    except TemplateNotFound:
        template = None
    builder = getattr(request.app.state, "builder", None)
    if template is not None or (builder is not None and builder.name_in_use(name)):
        what = f"template {template.template_id}" if template is not None else "a template"
        raise Conflict(f"snapshot name '{name}' is the name of {what}; "
                       "choose another (sandboxes are created from the template by that name)")
