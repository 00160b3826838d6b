"""Request and response bodies, shaped as E2B's REST API (camelCase on the wire)."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

# The SDK gates features on the envd version a sandbox reports.
from ..envd import ENVD_VERSION
from ..orchestrator import SandboxRecord


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int | None = Field(default=None, description="Time to live in seconds")
    auto_pause: bool = Field(default=False, alias="autoPause")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")


class TimeoutRequest(_Body):
    timeout: int


class ConnectRequest(_Body):
    timeout: int | None = None


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


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(default=None, serialization_alias="envdAccessToken")
    allow_internet_access: bool | None = None
    domain: str | None = None


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
        domain=domain,
    )


def listed(record: SandboxRecord) -> ListedSandbox:
    return ListedSandbox(**_common(record))


def detail(record: SandboxRecord, domain: str | None) -> SandboxDetail:
    return SandboxDetail(
        **_common(record), envd_access_token=record.envd_token,
        allow_internet_access=record.internet, domain=domain,
    )


def _common(record: SandboxRecord) -> dict:
    return {
        "template_id": record.template_id, "sandbox_id": record.sandbox_id,
        "client_id": record.node_id, "alias": record.alias,
        "started_at": _ts(record.started_at), "end_at": _ts(record.end_at),
        "cpu_count": record.cpu_count, "memory_mb": record.memory_mb,
        "disk_size_mb": record.disk_size_mb, "metadata": record.metadata,
        "state": record.state.value, "envd_version": ENVD_VERSION,
    }
