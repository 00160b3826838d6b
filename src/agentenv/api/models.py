"""Request and response bodies, shaped as E2B's REST API (camelCase on the wire)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

# The SDK gates features on the envd version a sandbox reports.
from ..envd.protocol import ENVD_VERSION
from ..orchestrator import OrchestratorError, SandboxRecord
from ..orchestrator.query import public_state
from ..resources import MIN_CPU_COUNT, MIN_MEMORY_MB
from ..templates import Template


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class AutoResume(_Body):
    """E2B's SandboxAutoResumeConfig."""

    enabled: bool = False


class ImageCredentials(_Body):
    """A registry's username and password (as ``POST /images`` takes them)."""

    username: str = Field(default="", max_length=1024)
    password: str = Field(default="", max_length=8192)


class NewSandbox(_Body):
    # One of templateID and image (``templateID: "docker://REF"`` names an image too).
    template_id: str = Field(default="", alias="templateID", max_length=256)
    # agentenv: start straight from an OCI image, pulled on first use (docs/templates.md).
    image: str | None = Field(default=None, max_length=1024,
                              description="An image reference in place of templateID")
    image_credentials: ImageCredentials | None = Field(default=None, alias="imageCredentials")
    # Run once per (image digest, command); the sandbox after it is kept as a snapshot
    # that later creates of the same pair restore.
    image_setup: str | None = Field(default=None, alias="imageSetup", max_length=16 << 10)
    # How the image's layers are loaded when this create pulls it: "lazy", "unpack" or
    # "auto" (by size); None: the node's image_loading. An image already pulled keeps
    # how it was loaded.
    image_loading: Literal["auto", "lazy", "unpack"] | None = Field(default=None,
                                                                   alias="imageLoading")
    # Maximums of times are the node's (max_timeout), checked by the orchestrator.
    timeout: int | None = Field(default=None, ge=0, description="Time to live in seconds")
    # Expiry pauses unless asked otherwise (agentenv's rule; E2B's API kills). The
    # e2b SDK leaves the field out without lifecycle.on_timeout, and sends false
    # for lifecycle={"on_timeout": "kill"}.
    auto_pause: bool = Field(default=True, alias="autoPause")
    # What that pause keeps: memory and files, or (false) the files only.
    auto_pause_memory: bool = Field(default=True, alias="autoPauseMemory")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    # Egress rules (allowOut / denyOut / ...); only "deny everything" is supported.
    network: dict[str, Any] | None = None
    # Traffic to its ports resumes the sandbox while it is paused.
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")


class TemplateBuildRequest(_Body):
    """``POST /v3/templates`` (E2B's TemplateBuildRequestV3; ``alias`` is v2's name).
    cpuCount and memoryMB have floors here; their maximums are the node's
    (agentenv.resources), checked by the builder."""

    name: str | None = Field(default=None, max_length=256)
    alias: str | None = Field(default=None, max_length=256)
    tags: list[Annotated[str, Field(max_length=128)]] | None = Field(default=None,
                                                                    max_length=64)
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=MIN_CPU_COUNT)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=MIN_MEMORY_MB)
    team_id: str | None = Field(default=None, alias="teamID")


class TimeoutRequest(_Body):
    timeout: int = Field(ge=0)


class RefreshRequest(_Body):
    duration: int | None = Field(default=None, ge=0, le=3600)


class ConnectRequest(_Body):
    timeout: int | None = Field(default=None, ge=0)
    # False (the SDK's on_resume="reboot"): boot from the paused sandbox's files alone.
    memory: bool = True


class SandboxCreated(_Body):
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(serialization_alias="clientID")
    envd_version: str = Field(serialization_alias="envdVersion")
    alias: str | None = None
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, serialization_alias="trafficAccessToken")
    domain: str | None = None


class ListedSandbox(_Body):
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(serialization_alias="clientID")
    alias: str | None = None
    started_at: datetime = Field(serialization_alias="startedAt")
    end_at: datetime = Field(serialization_alias="endAt")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    metadata: dict[str, str] = Field(default_factory=dict)
    state: str
    envd_version: str = Field(serialization_alias="envdVersion")
    # Why a sandbox in state "error" ended ("was killed: out of memory: ..."); else null.
    error: str | None = None
    # agentenv's timings (the SDKs keep fields they do not know as extra properties):
    # when the create arrived, was placed (startedAt), its runtime started, it was
    # ready; and the run that owns it.
    queued_at: datetime | None = Field(default=None, serialization_alias="queuedAt")
    placed_at: datetime | None = Field(default=None, serialization_alias="placedAt")
    booted_at: datetime | None = Field(default=None, serialization_alias="bootedAt")
    ready_at: datetime | None = Field(default=None, serialization_alias="readyAt")
    run_id: str | None = Field(default=None, serialization_alias="runID")


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    # The SDKs read `allowInternetAccess`; `allow_internet_access` (the create
    # request's spelling) is kept for clients of the first API version.
    allow_internet_access_v2: bool | None = Field(default=None,
                                                  serialization_alias="allowInternetAccess")
    allow_internet_access: bool | None = None
    domain: str | None = None
    # The egress policy in force (E2B's SandboxNetworkConfig shape).
    network: dict[str, Any] | None = None
    # E2B's SandboxLifecycle: {"autoResume": bool, "onTimeout": "pause" | "kill"}.
    lifecycle: dict[str, Any] | None = None


class SandboxMetric(_Body):
    timestamp: datetime
    timestamp_unix: int = Field(serialization_alias="timestampUnix")
    cpu_count: int = Field(serialization_alias="cpuCount")
    cpu_used_pct: float = Field(serialization_alias="cpuUsedPct")
    mem_used: int = Field(serialization_alias="memUsed")
    mem_total: int = Field(serialization_alias="memTotal")
    mem_cache: int = Field(serialization_alias="memCache")
    disk_used: int = Field(serialization_alias="diskUsed")
    disk_total: int = Field(serialization_alias="diskTotal")


class SandboxesWithMetrics(_Body):
    sandboxes: dict[str, SandboxMetric]


class TemplateInfo(_Body):
    """E2B's ``Template`` (what ``GET /templates`` and ``GET /v2/templates`` list)."""

    template_id: str = Field(serialization_alias="templateID")
    build_id: str = Field(serialization_alias="buildID")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    public: bool = True
    aliases: list[str]
    names: list[str]
    created_at: datetime = Field(serialization_alias="createdAt")
    updated_at: datetime = Field(serialization_alias="updatedAt")
    created_by: dict | None = Field(default=None, serialization_alias="createdBy")
    last_spawned_at: datetime | None = Field(default=None, serialization_alias="lastSpawnedAt")
    spawn_count: int = Field(default=0, serialization_alias="spawnCount")
    build_count: int = Field(default=1, serialization_alias="buildCount")
    envd_version: str = Field(serialization_alias="envdVersion")
    build_status: str = Field(default="ready", serialization_alias="buildStatus")
    is_default: bool = Field(default=False, serialization_alias="isDefault")


class TemplateBuildInfo(_Body):
    build_id: str = Field(serialization_alias="buildID")
    status: str = "ready"
    created_at: datetime = Field(serialization_alias="createdAt")
    updated_at: datetime = Field(serialization_alias="updatedAt")
    finished_at: datetime = Field(serialization_alias="finishedAt")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(serialization_alias="diskSizeMB")
    envd_version: str = Field(serialization_alias="envdVersion")


class TemplateWithBuilds(TemplateInfo):
    builds: list[TemplateBuildInfo]


class TemplateAlias(_Body):
    template_id: str = Field(serialization_alias="templateID")
    public: bool = True


class Health(_Body):
    status: str
    node_id: str = Field(serialization_alias="nodeID")
    sandboxes: int
    version: str


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def created(record: SandboxRecord, domain: str | None) -> SandboxCreated:
    return SandboxCreated(
        template_id=record.template_id, sandbox_id=record.sandbox_id, client_id=record.node_id,
        envd_version=ENVD_VERSION, alias=record.alias, envd_access_token=record.envd_token,
        traffic_access_token=record.traffic_token or None, domain=domain,
    )


def listed(record: SandboxRecord) -> ListedSandbox:
    return ListedSandbox(**_common(record))


def detail(record: SandboxRecord, domain: str | None) -> SandboxDetail:
    return SandboxDetail(
        **_common(record), envd_access_token=record.envd_token,
        allow_internet_access=record.internet, allow_internet_access_v2=record.internet,
        domain=domain, network={**record.network,
                                "allowPublicTraffic": not record.traffic_token,
                                **({"maskRequestHost": record.mask_request_host}
                                   if record.mask_request_host else {})},
        lifecycle={"autoResume": record.auto_resume,
                   "onTimeout": "pause" if record.auto_pause else "kill"},
    )


def metric(sample: dict[str, Any]) -> SandboxMetric:
    """envd's ``/metrics`` sample (snake_case) as the API's ``SandboxMetric``."""
    ts = int(sample.get("ts") or 0)
    return SandboxMetric(
        timestamp=_ts(ts), timestamp_unix=ts,
        cpu_count=int(sample.get("cpu_count", 0)),
        cpu_used_pct=float(sample.get("cpu_used_pct", 0.0)),
        mem_used=int(sample.get("mem_used", 0)), mem_total=int(sample.get("mem_total", 0)),
        mem_cache=int(sample.get("mem_cache", 0)),
        disk_used=int(sample.get("disk_used", 0)), disk_total=int(sample.get("disk_total", 0)),
    )


def template_build_id(template: Template) -> str:
    """The template's build ID as the SDKs parse it (a UUID); derived when not one."""
    return build_uuid(template.template_id, template.build_id)


def build_uuid(template_id: str, build_id: str) -> str:
    try:
        return str(uuid.UUID(build_id))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"agentenv:template:{template_id}:{build_id}"))


def _template_times(template: Template) -> tuple[datetime, datetime]:
    created = None
    if template.created_at:
        try:
            created = datetime.fromisoformat(template.created_at.replace("Z", "+00:00"))
        except ValueError:
            created = None
    if created is None:
        try:
            created = _ts((template.rootfs.parent / "template.json").stat().st_mtime)
        except OSError:
            created = _ts(0)
    return created, created


def template_info(template: Template, spawned: int = 0) -> TemplateInfo:
    created, updated = _template_times(template)
    names = list(template.aliases) or [template.template_id]
    return TemplateInfo(
        template_id=template.template_id, build_id=template_build_id(template),
        cpu_count=template.cpu_count, memory_mb=template.memory_mb,
        disk_size_mb=template.disk_size_mb, aliases=list(template.aliases), names=names,
        created_at=created, updated_at=updated, spawn_count=spawned,
        envd_version=ENVD_VERSION, is_default=template.template_id == "base",
    )


def template_with_builds(template: Template, spawned: int = 0) -> TemplateWithBuilds:
    info = template_info(template, spawned)
    build = TemplateBuildInfo(
        build_id=info.build_id, created_at=info.created_at, updated_at=info.updated_at,
        finished_at=info.updated_at, cpu_count=template.cpu_count, memory_mb=template.memory_mb,
        disk_size_mb=template.disk_size_mb, envd_version=ENVD_VERSION,
    )
    return TemplateWithBuilds(**info.model_dump(), builds=[build])


def _common(record: SandboxRecord) -> dict:
    return {
        "template_id": record.template_id, "sandbox_id": record.sandbox_id,
        "client_id": record.node_id, "alias": record.alias,
        "started_at": _ts(record.started_at), "end_at": _ts(record.end_at),
        "cpu_count": record.cpu_count, "memory_mb": record.memory_mb,
        "disk_size_mb": record.disk_size_mb, "metadata": record.metadata,
        "state": public_state(record) or "running", "envd_version": ENVD_VERSION,
        "error": record.error or None,
        "queued_at": _ts(record.queued_at) if record.queued_at else None,
        "placed_at": _ts(record.started_at),
        "booted_at": _ts(record.booted_at) if record.booted_at else None,
        "ready_at": _ts(record.ready_at) if record.ready_at else None,
        "run_id": record.run_id or None,
    }


# -- the sandboxes of a fork or a batch create ----------------------------------------

NDJSON = "application/x-ndjson"
NDJSON_RESPONSES: dict[int | str, dict[str, Any]] = {
    201: {"content": {NDJSON: {}},
          "description": "With `Accept: application/x-ndjson`: one result a line, each "
                         "as its sandbox comes up"}}


class ChildError(_Body):
    code: int
    message: str


class ChildResult(_Body):
    """One sandbox of a fork or a batch: the sandbox, or the error that stopped it."""

    sandbox: SandboxCreated | None = None
    error: ChildError | None = None


def child_result(result: SandboxRecord | OrchestratorError, domain: str | None
                 ) -> ChildResult:
    if isinstance(result, OrchestratorError):
        return ChildResult(error=ChildError(code=result.status, message=str(result)))
    return ChildResult(sandbox=created(result, domain))


async def children_answer(children: AsyncIterator[SandboxRecord | OrchestratorError],
                          request: Request) -> list[ChildResult] | StreamingResponse:
    """The results as one JSON list once all are in, or (``Accept: application/x-ndjson``)
    a line each as it comes. Errors of the whole (raised before the first result)
    answer with their own status either way."""
    domain = request.app.state.config.domain
    if NDJSON not in request.headers.get("accept", ""):
        return [child_result(r, domain) async for r in children]
    first = await anext(children)

    async def lines() -> AsyncIterator[bytes]:
        for result in (first,):
            yield _line(result, domain)
        async for result in children:
            yield _line(result, domain)

    return StreamingResponse(lines(), status_code=201, media_type=NDJSON)


def _line(result: SandboxRecord | OrchestratorError, domain: str | None) -> bytes:
    return child_result(result, domain).model_dump_json(by_alias=True, exclude_none=True
                                                        ).encode() + b"\n"
