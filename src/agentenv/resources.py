"""Bounds on a sandbox's resources: one check for every way cpuCount, memoryMB and
diskSizeMB enter.

A request (a template build, a create asking for resources) outside the bounds is
refused with the field and the bound named; a value read from disk (a template's
template.json, a snapshot's metadata, a build record, the sandbox store) is
clamped into them, never trusted: a sandbox with a memory limit beyond the host
has no memory protection, and its RLIMIT_NPROC (derived from its memory) no
fork-bomb protection.

The maximums come from the node's config (``max_cpu_count``, ``max_memory_mb``,
``max_disk_mb``); by default they are derived from the host (``host_limits``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MIN_CPU_COUNT = 1
# envd (a Python process) and gVisor's sentry need about this much to start.
MIN_MEMORY_MB = 128
MIN_DISK_MB = 16
# The API's spelling of each resource, as the errors name them.
CPU, MEMORY, DISK = "cpuCount", "memoryMB", "diskSizeMB"


class ResourceError(ValueError):
    """A requested resource outside the node's bounds (an API 400)."""


def host_cpus() -> int:
    return os.cpu_count() or 1


def host_memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (OSError, ValueError):
        return 4096


# Host memory an idle `base` sandbox holds, with a margin: ~52 MiB PSS over all its
# runsc processes measured (bench/results/density.md). Frozen, it costs no CPU; not
# frozen, ~3-4 % of a core, so without idle freezing the cores bound the count too.
SANDBOX_HOST_MB = 64
HOST_RESERVE_MB = 2048  # the node, its caches and the host's own needs
IDLE_SANDBOXES_PER_CORE = 32
MAX_DERIVED_SANDBOXES = 4096


def host_capacity(idle_freezing: bool) -> int:
    """Sandboxes (and network slots) a node holds at once by default: what the host's
    memory holds of idle sandboxes, and with no idle freezing what its cores keep up."""
    memory = host_memory_mb()
    count = (memory - min(HOST_RESERVE_MB, memory // 4)) // SANDBOX_HOST_MB
    if not idle_freezing:
        count = min(count, host_cpus() * IDLE_SANDBOXES_PER_CORE)
    return max(1, min(count, MAX_DERIVED_SANDBOXES))


def host_limits() -> tuple[int, int, int]:
    """The default maximums: every core of the host for CPU; half of its RAM for
    memory, and as much for the writable layer (which lives in sandbox memory)."""
    memory = max(MIN_MEMORY_MB, host_memory_mb() // 2)
    return host_cpus(), memory, memory


@dataclass(frozen=True)
class ResourceLimits:
    max_cpu_count: int
    max_memory_mb: int
    max_disk_mb: int

    @classmethod
    def from_config(cls, config: Any) -> ResourceLimits:
        cpu, memory, disk = host_limits()
        return cls(max_cpu_count=getattr(config, "max_cpu_count", 0) or cpu,
                   max_memory_mb=getattr(config, "max_memory_mb", 0) or memory,
                   max_disk_mb=getattr(config, "max_disk_mb", 0) or disk)

    def bounds(self, name: str) -> tuple[int, int]:
        return {CPU: (MIN_CPU_COUNT, self.max_cpu_count),
                MEMORY: (MIN_MEMORY_MB, self.max_memory_mb),
                DISK: (MIN_DISK_MB, self.max_disk_mb)}[name]

    def check(self, name: str, value: Any) -> int | None:
        """A requested value (None: not asked for), or ResourceError naming the bound."""
        if value is None:
            return None
        low, high = self.bounds(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ResourceError(f"{name} must be an integer between {low} and {high}")
        if value < low:
            raise ResourceError(f"{name} must be at least {low} (got {value})")
        if value > high:
            raise ResourceError(f"{name} must be at most {high}, this node's maximum "
                                f"(got {value})")
        return value

    def clamp(self, name: str, value: Any, default: int = 0) -> int:
        """A value read from disk, within the bounds; missing, 0 and garbage become
        ``default`` (within the bounds too; a default of 0, as diskSizeMB's, means
        "the node's default" and stays 0)."""
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            number = default
        if number <= 0:
            number = default
        if number <= 0:
            return 0
        low, high = self.bounds(name)
        return min(max(number, low), high)
