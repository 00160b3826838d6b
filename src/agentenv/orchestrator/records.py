"""One way to make a sandbox record, whatever the sandbox comes from (a template, a
fork, a snapshot, a paused sandbox another node had)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .models import SandboxRecord, SandboxState, new_sandbox_id


@dataclass(frozen=True)
class Resources:
    cpu_count: int
    memory_mb: int
    disk_size_mb: int


def new_record(*, node_id: str, template_id: str, alias: str, resources: Resources,
               ttl: float, auto_pause: bool, internet: bool, network: Mapping | None = None,
               auto_pause_memory: bool = True,
               private_ports: bool = False, metadata: Mapping[str, str] | None = None,
               env_vars: Mapping[str, str] | None = None, sandbox_id: str = "",
               state: SandboxState = SandboxState.CREATING, envd_token: str = "",
               snapshot_id: str = "", started_at: float | None = None,
               auto_resume: bool = False, resume_timeout: int = 0,
               mask_request_host: str = "", owner: str = "", run_id: str = "",
               queued_at: float = 0.0, origin: str = "",
               traffic_token: str = "") -> SandboxRecord:
    """A record with a fresh unguessable ID and envd token (unless given: an adopted
    pause keeps its own), ending ``ttl`` seconds from now."""
    now = time.time()
    return SandboxRecord(
        sandbox_id=sandbox_id or new_sandbox_id(),
        template_id=template_id,
        alias=alias,
        state=state,
        node_id=node_id,
        cpu_count=resources.cpu_count,
        memory_mb=resources.memory_mb,
        disk_size_mb=resources.disk_size_mb,
        started_at=now if started_at is None else started_at,
        end_at=now + ttl,
        auto_pause=auto_pause,
        auto_pause_memory=auto_pause_memory,
        internet=internet,
        network=dict(network or {}),
        traffic_token=traffic_token or (secrets.token_urlsafe(32) if private_ports else ""),
        metadata=dict(metadata or {}),
        env_vars=dict(env_vars or {}),
        envd_token=envd_token or secrets.token_urlsafe(32),
        snapshot_id=snapshot_id,
        auto_resume=auto_resume,
        resume_timeout=resume_timeout,
        mask_request_host=mask_request_host,
        owner=owner,
        run_id=run_id,
        queued_at=queued_at or now,
        origin=origin,
    )
