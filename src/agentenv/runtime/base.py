"""The runtime driver protocol: what the orchestrator may ask of an isolation engine.

The orchestrator speaks only in these terms; each driver (gVisor today, a VM
driver later) owns its engine's flags, files and processes.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class RuntimeFailure(RuntimeError):
    """The engine refused or failed an operation; the message says why."""


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a driver needs to start one sandbox."""

    sandbox_id: str
    rootfs: Path  # the template's root filesystem, shared and never written
    hostname: str
    cpu_count: int
    memory_mb: int
    netns_path: str  # the sandbox's network namespace (a slot)
    runtime_bundle: Path  # host directory mounted read-only at bundle_mount
    bundle_mount: str
    init_args: list[str]  # the sandbox's first process (envd)
    init_env: dict[str, str] = field(default_factory=dict)
    disk_mb: int = 0  # quota of the writable root layer (0: none)


@dataclass(frozen=True)
class RuntimeSandbox:
    sandbox_id: str
    state: str  # engine-reported: running, paused, stopped, created
    pid: int


class Runtime(Protocol):
    kind: str
    # Called in the event loop with (sandbox ID, why: "was killed: out of memory: ...")
    # as soon as a sandbox's engine process ends without the node stopping it.
    on_exit: Callable[[str, str], None] | None

    @property
    def version(self) -> str: ...

    async def start(self, spec: SandboxSpec) -> RuntimeSandbox:
        """Start the sandbox; return once its init process runs (not when envd answers)."""

    async def destroy(self, sandbox_id: str) -> None:
        """Stop the sandbox and release everything the engine holds for it. Idempotent."""

    async def checkpoint(self, sandbox_id: str, image_dir: Path, leave_running: bool) -> None:
        """Save the sandbox's full state into ``image_dir``."""

    def capture_size(self, sandbox_id: str) -> int:
        """About how many bytes a checkpoint of the sandbox writes now (0: unknown)."""

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> RuntimeSandbox:
        """Start a sandbox from the state in ``image_dir``."""

    async def state(self, sandbox_id: str) -> RuntimeSandbox | None:
        """What the engine says of one sandbox now; None if it knows none by that ID."""

    async def pause(self, sandbox_id: str) -> None: ...

    async def resume(self, sandbox_id: str) -> None: ...

    def freeze(self, sandbox_id: str) -> bool:
        """Stop the sandbox's processes in place (no CPU; memory kept) until ``thaw`` or
        any operation on it; False when it cannot be frozen now."""

    def thaw(self, sandbox_id: str) -> bool:
        """Let a frozen sandbox run again; True if it was frozen."""

    def frozen_count(self) -> int:
        """Sandboxes frozen now."""

    def is_frozen(self, sandbox_id: str) -> bool:
        """Whether the sandbox is frozen now (any operation on it thaws it)."""

    def reclaim(self, sandbox_id: str) -> tuple[int, int]:
        """Move a frozen sandbox's memory out of RAM (to the host's compressed swap)
        while it stays frozen; its next request faults back what it touches. Returns
        the bytes that left RAM (0: not frozen, no swap, or at its limit already) and
        those still in RAM. Blocking: the orchestrator calls it from a thread."""

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """Host CPU time the sandbox used so far (None: unknown)."""

    def envd_dormant(self, sandbox_id: str) -> bool:
        """Whether the sandbox's envd is dormant now (envd/dormancy.py), as its console
        says: nothing runs in it, and asking envd anything would wake it."""

    async def list(self) -> dict[str, RuntimeSandbox]:
        """Every sandbox this driver's state directory knows, by ID."""

    async def housekeeping(self) -> None:
        """Periodic upkeep (the orchestrator calls it about once a second)."""

    async def settle(self, wait_s: float) -> int:
        """At start: wait for engine commands a previous node process left running
        (their outcome decides what each sandbox is); return how many there were."""

    async def reconcile(self, keep: set[str]) -> builtins.list[str]:
        """Destroy every sandbox and leftover not in ``keep``; return what was removed."""
