"""What a create asks for, and the checks every field passes before anything starts."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..network import EgressPolicy
from ..resources import CPU, MEMORY, ResourceError, ResourceLimits
from .models import BadRequest

MAX_METADATA_ENTRIES = 64
MAX_ENV_ENTRIES = 256
# Characters of one metadata key and value (metadata is stored with the sandbox, in
# its snapshots, and in every listing), and of one env var (Linux's MAX_ARG_STRLEN
# is 128 KiB for NAME=value).
MAX_METADATA_KEY, MAX_METADATA_VALUE = 256, 8 * 1024
MAX_ENV_NAME, MAX_ENV_VALUE = 1024, 128 * 1024 - 1024 - 2
MAX_FORK = 16


@dataclass
class CreateRequest:
    template: str
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    # What a timeout's pause keeps (E2B autoPauseMemory): False, the files only.
    auto_pause_memory: bool = True
    internet: bool = True
    # Finer egress policy (E2B's network.allowOut / denyOut); None = by ``internet``.
    network: EgressPolicy | None = None
    # False: the sandbox's ports want its traffic access token (E2B allowPublicTraffic).
    public_traffic: bool = True
    # E2B's autoResume: traffic through the proxy resumes the sandbox while paused.
    auto_resume: bool = False
    # E2B's network.maskRequestHost (checked by the API: web.routing.check_mask_host).
    mask_request_host: str = ""
    # Resources other than the template's (template builds ask for them): such a
    # sandbox boots, as no template image or pooled sandbox has them.
    cpu_count: int | None = None
    memory_mb: int | None = None
    # Who asks (the API key's ID: quotas and fairness are per owner), the run the
    # sandbox joins ("" none), and whether the client has hung up (a create waiting
    # for room then gives up its place).
    owner: str = ""
    run_id: str = ""
    client_gone: Callable[[], Awaitable[bool]] | None = None
    # When the create arrived (the record's ``queued_at``).
    queued_at: float = field(default_factory=time.time)

    @property
    def custom_resources(self) -> bool:
        return bool(self.cpu_count or self.memory_mb)

    def stamps(self) -> dict:
        """The record fields a create sets from its request: owner, run, arrival."""
        return {"owner": self.owner, "run_id": self.run_id, "queued_at": self.queued_at}

    def ingress(self, ttl: int) -> dict:
        """The record fields for traffic to the sandbox: a resume by traffic runs for the
        create's timeout (E2B's autoResume timeout), and the Host its ports see."""
        return {"auto_resume": self.auto_resume, "resume_timeout": ttl if self.auto_resume else 0,
                "mask_request_host": self.mask_request_host}


def check_create(req: CreateRequest, limits: ResourceLimits) -> None:
    """Refuse (400) what no sandbox can be made with; nothing has started yet."""
    check_str_map("metadata", req.metadata, MAX_METADATA_ENTRIES, MAX_METADATA_KEY,
                  MAX_METADATA_VALUE)
    check_str_map("envVars", req.env_vars, MAX_ENV_ENTRIES, MAX_ENV_NAME, MAX_ENV_VALUE)
    check_env(req.env_vars)
    try:
        limits.check(CPU, req.cpu_count)
        limits.check(MEMORY, req.memory_mb)
    except ResourceError as exc:
        raise BadRequest(str(exc)) from exc


def check_timeout(timeout: int | None, default: int, maximum: int) -> int:
    if timeout is None:
        return default
    if timeout < 0:
        raise BadRequest("timeout must not be negative")
    if timeout > maximum:
        raise BadRequest(f"timeout must be at most {maximum} seconds")
    return timeout


def check_fork_count(count: int) -> None:
    if not 1 <= count <= MAX_FORK:
        raise BadRequest(f"count must be between 1 and {MAX_FORK}")


def check_env(env: dict[str, str]) -> None:
    """What a process environment can hold (a NUL byte once reached envd: a 500)."""
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise BadRequest(f"envVars: {k!r} is not a valid environment variable "
                             "(names are non-empty without '='; no NUL bytes)")


def check_str_map(name: str, value: dict, limit: int, key_max: int, value_max: int) -> None:
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object of strings")
    if len(value) > limit:
        raise BadRequest(f"{name} has {len(value)} entries; at most {limit} are allowed")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise BadRequest(f"{name} must map strings to strings")
        if len(k) > key_max:
            raise BadRequest(f"{name}: a key of {len(k)} characters; at most {key_max}")
        if len(v) > value_max:
            raise BadRequest(f"{name}: the value of {k[:64]!r} has {len(v)} characters; "
                             f"at most {value_max}")
