"""What a user reads when a sandbox's runtime ends unasked (``exits.exit_reason``), from
its memory cgroup's files as cgroup v1 writes them (here: a directory of such files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.runtime.exits import MIB, exit_reason

OWN = 640 * MIB  # a 512 MB sandbox's host limit
LIFTED = OWN + 160 * MIB


def _cgroup(tmp_path: Path, *, peak: int, limit: int, oom_kills: int = 0) -> Path:
    (tmp_path / "memory.oom_control").write_text(
        f"oom_kill_disable 1\nunder_oom 0\noom_kill {oom_kills}\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text(f"{peak}\n")
    (tmp_path / "memory.limit_in_bytes").write_text(f"{limit}\n")
    return tmp_path


def test_ended_by_the_node_after_holding_it(tmp_path: Path) -> None:
    cg = _cgroup(tmp_path, peak=LIFTED, limit=LIFTED)
    assert exit_reason(cg, 512, held_at_limit=True, own_limit=OWN, lifted=True) == (
        "was killed: out of memory: the sandbox reached its 640 MB limit (512 MB of memory "
        "plus 128 MB for its kernel) and envd could not free memory; the node ended it")


@pytest.mark.parametrize("limit", [LIFTED, OWN])  # its lift taken back, or not yet
def test_ended_on_its_own_while_held(tmp_path: Path, limit: int) -> None:
    cg = _cgroup(tmp_path, peak=LIFTED, limit=limit)
    assert exit_reason(cg, 512, own_limit=OWN, lifted=True) == (
        "was killed: out of memory: the sandbox reached its 640 MB limit (512 MB of memory "
        "plus 128 MB for its kernel) and its runtime ended there")


def test_killed_by_the_hosts_oom_killer(tmp_path: Path) -> None:
    cg = _cgroup(tmp_path, peak=OWN, limit=OWN, oom_kills=1)
    assert exit_reason(cg, 512).startswith(
        "was killed: out of memory: the sandbox used 640 MB of its 640 MB limit (512 MB of "
        "memory plus 128 MB for its kernel); the host's OOM killer stopped it")


def test_a_peak_long_ago_is_not_blamed(tmp_path: Path) -> None:
    """At its limit once (envd freed memory then), ended later for another reason."""
    cg = _cgroup(tmp_path, peak=LIFTED, limit=OWN)
    assert exit_reason(cg, 512, own_limit=OWN, lifted=False) == (
        "exited: its runtime process ended (peak memory 800 MB of its 640 MB limit)")


def test_no_cgroup_left(tmp_path: Path) -> None:
    assert exit_reason(tmp_path / "gone", 512) == "exited: its runtime process ended"
