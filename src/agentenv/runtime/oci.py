"""OCI runtime spec for one sandbox (the config.json runsc reads)."""

from __future__ import annotations

import os
from typing import Any

from .base import SandboxSpec

# Docker's default capability set minus NET_RAW: root inside keeps the
# privileges package managers and sudo need, and no raw sockets. Plus SYS_ADMIN
# for envd (pid 1) alone: it mounts the boot ID's tmpfs at start-up, then drops it
# from all its sets, bounding included, before it forks anything (envd/bootid.py).
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SYS_ADMIN",
]
# A short CFS period: a throttled sandbox waits at most ~10 ms, not 100, so a
# busy neighbour costs others little latency.
CPU_PERIOD_US = 10_000
# Kept free of any one sandbox (in cores): the node and other sandboxes always
# get some CPU at once, however busy one sandbox is.
CPU_RESERVE = 0.5
CPU_SHARES_PER_CORE = 1024  # weight by size: fair between sandboxes under load
PIDS_LIMIT = 4096  # host threads of the sandbox (the sentry's), not its processes
# Processes per user inside the sandbox, per MiB of its memory (gVisor enforces
# RLIMIT_NPROC; root inside has no CAP_SYS_RESOURCE): a fork bomb meets EAGAIN
# before its processes outgrow the sandbox's memory (at 2 per MiB it took the
# whole sandbox down; at 1 per 2 MiB the sandbox lives on).
NPROC_PER_MIB = 0.5
NPROC_MIN = 128


def nproc_limit(memory_mb: int) -> int:
    return max(NPROC_MIN, int(memory_mb * NPROC_PER_MIB))


def writable_mb(disk_mb: int, memory_mb: int) -> int:
    """What the sandbox may keep in files (root layer and /tmp together, both in its
    memory): the disk quota, but never more than 3/4 of the memory they live in."""
    return max(16, min(disk_mb, memory_mb * 3 // 4))


def files_quota_mb(disk_mb: int, memory_mb: int) -> int:
    """What envd's guard allows in / and /tmp together before it stops their writers:
    the writable budget, plus a little so that one file or /tmp alone meets its own
    limit (RLIMIT_FSIZE, the tmpfs size: enforced by gVisor at once) first. The guard
    polls: parallel writers at GB/s overshoot it by 100-190 MB here."""
    return writable_mb(disk_mb, memory_mb) + 8


def file_size_limit(disk_mb: int, memory_mb: int) -> int:
    """RLIMIT_FSIZE in bytes: no one file outgrows the disk quota, nor the memory its
    in-memory root layer lives in (gVisor enforces it at once: a filler gets SIGXFSZ
    where a polling guard came a few hundred MB too late at GB/s)."""
    return writable_mb(disk_mb, memory_mb) * MIB


def tmp_mount(disk_mb: int, memory_mb: int) -> dict[str, Any]:
    """/tmp as a tmpfs of bounded size. Without it runsc mounts an internal tmpfs with
    no limit but memory: four files each under RLIMIT_FSIZE filled it past the host
    cgroup's limit and the host OOM-killed the whole sandbox. With it, a filler gets
    ENOSPC at once; envd's guard keeps / and /tmp together within the same budget."""
    return {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777",
                        f"size={writable_mb(disk_mb or memory_mb, memory_mb)}m"]}


MIB = 1024 * 1024


def cpu_quota_us(cpu_count: int, host_cpus: int | None = None) -> int:
    """The sandbox's CPU time per period: its cores, less a reserve when that would be
    the whole host."""
    host = host_cpus or os.cpu_count() or 1
    cores = min(float(cpu_count), max(0.5, host - CPU_RESERVE))
    return int(cores * CPU_PERIOD_US)


def host_memory_limit(memory_mb: int) -> int:
    """The hard limit on the host cgroup, in bytes.

    gVisor's sentry shares the cgroup with the workload and the host OOM killer
    takes the whole sandbox down, so the host limit carries headroom; the
    requested figure is enforced per process inside by envd's OOM guard.
    """
    return (memory_mb + max(128, memory_mb // 4)) * MIB


def pressure_threshold(memory_mb: int, limit_bytes: int) -> int:
    """Host cgroup usage (bytes) past which the node tells envd to free memory.

    What is left above it is what a fast allocator (300-400 MB/s inside gVisor here)
    may take while the node signals envd (`runsc kill`, ~20 ms) and envd kills and
    the sentry gives the memory back. 300 MB of socket memory in the sentry, then a
    hog: with 96 MB left the host OOM-killed the sandbox in 3 runs of 8, with 128 MB
    in 1 of 6 (it went 524 -> 640 MB in 200 ms). So 128 MB (a 512 MB sandbox: from
    its own size up, and the sentry's ~70 MB come off what the guest can use before
    the node steps in), or half the headroom when that is more."""
    headroom = limit_bytes - memory_mb * MIB
    if not memory_mb or headroom <= 0:
        return limit_bytes * 3 // 4
    return max(limit_bytes // 2, limit_bytes - max(128 * MIB, headroom // 2))


def build_spec(spec: SandboxSpec, cgroups_path: str) -> dict[str, Any]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    env.update(spec.init_env)
    caps = list(CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.init_args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1 << 20, "soft": 1 << 20},
                        {"type": "RLIMIT_NPROC", "hard": nproc_limit(spec.memory_mb),
                         "soft": nproc_limit(spec.memory_mb)},
                        *([{"type": "RLIMIT_FSIZE",
                            "hard": file_size_limit(spec.disk_mb, spec.memory_mb),
                            "soft": file_size_limit(spec.disk_mb, spec.memory_mb)}]
                          if spec.disk_mb else [])],
        },
        # Not read-only: runsc puts a private writable overlay over it, and the
        # template directory underneath is never written.
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            tmp_mount(spec.disk_mb, spec.memory_mb),
            {"destination": spec.bundle_mount, "type": "bind",
             "source": str(spec.runtime_bundle), "options": ["rbind", "ro"]},
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                {"type": "network", "path": spec.netns_path},
            ],
            "resources": {
                # No swap but the node's reclaim of a frozen sandbox (reclaim.py).
                "memory": {"limit": host_memory_limit(spec.memory_mb), "swappiness": 0},
                "cpu": {"quota": cpu_quota_us(spec.cpu_count), "period": CPU_PERIOD_US,
                        "shares": CPU_SHARES_PER_CORE * max(1, spec.cpu_count)},
                "pids": {"limit": PIDS_LIMIT},
            },
            "cgroupsPath": cgroups_path,
        },
    }
