"""The tests' own Docker engine (agentenv.testing.docker_engine) outlives no test run:
one whose owner was killed (kill -9 mid-file, as an interrupted `make test`) is stopped
by the next run, and one whose owner still runs is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentenv.testing.docker_engine import DockerEngine
from agentenv.testing.nodes import free_cidr

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from agentenv.testing.docker_engine import DockerEngine
    root, netns, net = sys.argv[1], sys.argv[2], int(sys.argv[3])
    DockerEngine(Path(root), netns, netns + "h", net).start()
    print("up", flush=True)
    time.sleep(600)
""")


def dockerds_under(root: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"dockerd .*{root}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def netns_names() -> list[str]:
    return [line.split()[0] for line in
            subprocess.run(["ip", "netns", "list"], capture_output=True, text=True
                           ).stdout.splitlines() if line.strip()]


@pytest.fixture
def owner():
    """An engine started by a process of its own (its owner), which the test kills."""
    tag = f"{os.getpid() % 1296:x}r"
    root, netns = Path(f"/tmp/aenv-docker-{tag}"), f"aedk{tag}"
    net = int(free_cidr(240, 10, os.getpid() + 5).split(".")[1])
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(root), netns, str(net)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield proc, root, netns
    finally:
        proc.kill()
        proc.wait()
        DockerEngine(root, netns, netns + "h", 0).stop()  # whatever the test left


def test_an_engine_whose_owner_was_killed_is_stopped_by_the_next_run(owner) -> None:
    proc, root, netns = owner
    assert dockerds_under(root) and netns in netns_names()
    # Its owner still runs: another run's engine, left alone.
    assert str(root) not in DockerEngine.reap_abandoned(Path("/tmp"), "aenv-docker-*")
    assert dockerds_under(root)
    proc.send_signal(signal.SIGKILL)  # no teardown runs
    proc.wait()
    assert dockerds_under(root), "dockerd outlives its owner (what this reaping is for)"
    # (test_deploy_compose's set-up reaps too, and may be first: what counts is the end)
    DockerEngine.reap_abandoned(Path("/tmp"), "aenv-docker-*")
    assert dockerds_under(root) == []
    assert netns not in netns_names()
    assert not root.exists()
