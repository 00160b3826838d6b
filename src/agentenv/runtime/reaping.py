"""The node as subreaper: runsc's sandbox processes that outlive their parent become
the node's children, and the node reaps them (a zombie never goes by itself)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time


def become_subreaper() -> None:
    """Orphaned sandbox processes become the node's children, so it reaps them at once."""
    pr_set_child_subreaper = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def alive(pid: int) -> bool:
    """Running (a zombie is not: it has done its work)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def reap_runsc_orphans() -> None:
    """Reap exited runsc helpers that were reparented to us (we are a subreaper).

    Only zombies named ``exe`` (runsc re-executes /proc/self/exe) are touched;
    the node's own direct children are waited for by whoever started them.
    Usually no child has exited: one peek (``WNOWAIT`` leaves it waitable) says so
    without the scan of every process, which costs tens of ms with many sandboxes.
    """
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return  # no children at all
        if exited is None:
            return
        if _comm(exited.si_pid) != "exe":
            break  # another's to wait for: look past it below
        with contextlib.suppress(ChildProcessError):
            os.waitpid(exited.si_pid, os.WNOHANG)
    _reap_by_scan()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.index("(") + 1:stat.rindex(")")]


def _reap_by_scan() -> None:
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == me and comm == "exe":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)


def reap(pids: list[int], deadline: float) -> None:
    """Wait for these pids to be gone: reaped by us when ours, else by their parent."""
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    waiting.discard(pid)
            except ChildProcessError:  # not our child (adopted after a restart)
                if not os.path.exists(f"/proc/{pid}"):
                    waiting.discard(pid)
        if waiting:
            time.sleep(0.002)
