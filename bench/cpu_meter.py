"""CPU-seconds of one node and everything it starts, read from cgroup v1 cpuacct.

A node's own process and the short-lived processes it runs (runsc invocations, `ip`,
`iptables`, unshare wrappers) sit in a cpuacct cgroup of their own; each sandbox's
sentry and gofer sit in ``/<prefix>/<sandbox id>`` (runsc joins the spec's cgroup
path), under the node's prefix. cgroup v1 charges every ancestor at the moment CPU is
used, so the prefix cgroup keeps what removed sandboxes used. Both counters together
are the node's host-wide CPU, whatever else runs on the machine: other users' load
only stretches the wall time.
"""

from __future__ import annotations

import os
from pathlib import Path

ACCT = Path("/sys/fs/cgroup/cpuacct")


def _usage_ns(group: Path) -> int:
    try:
        return int((group / "cpuacct.usage").read_text())
    except (OSError, ValueError):
        return 0


def _split_ns(group: Path) -> tuple[int, int]:
    """(user, system) of a group, in ns (cpuacct.stat is in USER_HZ ticks)."""
    try:
        fields = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0, 0
    tick = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return int(fields.get("user", 0)) * tick, int(fields.get("system", 0)) * tick


class CpuMeter:
    """The CPU of one node: its own cgroup (created here, the node's process tree moved
    into it) plus its sandboxes' parent cgroup."""

    def __init__(self, prefix: str, node_pid: int):
        self.node_group = ACCT / f"bench-node-{prefix}"
        self.node_group.mkdir(exist_ok=True)
        self.sandbox_group = ACCT / prefix
        self.sandbox_group.mkdir(exist_ok=True)  # runsc makes it if missing; same thing
        for pid in _session_pids(node_pid):
            try:
                (self.node_group / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # ended meanwhile

    def read(self) -> dict[str, int]:
        """Cumulative ns: node (its process and children), sandboxes (sentries, gofers)."""
        return {"node": _usage_ns(self.node_group), "sandboxes": _usage_ns(self.sandbox_group)}

    @staticmethod
    def delta_s(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
        out = {k: (after[k] - before[k]) / 1e9 for k in before}
        out["total"] = sum(out.values())
        return out

    def close(self) -> None:
        """Remove the node's group once its processes are gone (rmdir fails otherwise)."""
        for group in (self.node_group,):
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (ACCT / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass


def _session_pids(pid: int) -> list[int]:
    """The node's process and every process in its session (it starts its own)."""
    sid = os.getsid(pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out
