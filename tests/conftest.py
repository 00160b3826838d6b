"""Shared fixtures: a real node server (runsc, netns, envd) for the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentenv.testing import Node, free_cidr, leaks, sdk_env

# Per session, so that two test runs on one machine never take each other's
# slots for crash leftovers (each node removes unknown slots of its prefix).
TEST_PREFIX = f"t{os.getpid() % 46656:03x}"
# 10.50-89 is the session nodes' alone: the nodes single test files start use
# fixed or per-file ranges (10.13-44, 10.120-249); a session node sharing one with
# them (as 10.100-199 could) broke their creates on the host's routes. Under
# pytest-xdist each worker has a session node, in a share of its own of that range
# (a half each of two workers, a quarter each of up to four).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE = 40 // min(max(WORKERS, 2), 4)
TEST_CIDR = free_cidr(50 + _SHARE * (int(WORKER) % (40 // _SHARE) if WORKER.isdigit() else 0),
                      _SHARE, os.getpid())


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    home = tmp_path_factory.mktemp("node")
    server = Node(home, TEST_PREFIX, TEST_CIDR)
    server.start()
    with sdk_env(server.e2b_env()):
        yield server
    code = server.stop()
    left = leaks(TEST_PREFIX, home)
    # uvicorn re-raises SIGTERM after its graceful shutdown.
    assert code in (0, -15), f"node exited with {code}:\n{server.log_tail()}"
    assert "node stopped cleanly" in server.log_tail(), server.log_tail()
    assert not left, f"node left behind: {left}"


@pytest.fixture
def api(node: Node):
    with node.client() as client:
        yield client


# The files that take longest (seconds of one worker, summed per file from each test's
# setup, call and teardown, in a `make test` on this 2-core machine), started first:
# `make test` hands whole files to the workers, and a long file left for last makes
# the run as long as it (longest first keeps the tail short). The Makefile passes
# --no-loadscope-reorder: without it pytest-xdist orders the files by their number of
# tests instead, and this order is lost. Every `make test` log ends with the slowest
# steps (--durations): re-rank from there when this drifts.
SLOW_FILES = ("test_envd_dormant.py", "test_crash_safety.py", "test_cluster.py",
              "test_idle_freeze.py", "test_sandbox_snapshots.py", "test_e2b_js.py",
              "test_code_interpreter_parity.py", "test_fork.py", "test_cli.py",
              "test_security_round3.py", "test_images_node.py", "test_template_build_cli.py",
              "test_security_memory.py", "test_crash.py", "test_snapshot_store.py",
              "test_deploy_compose.py", "test_e2b_code_interpreter.py",
              "test_images_cleanup.py", "test_rl_client.py", "test_rl_server.py",
              "test_images_lazy.py", "test_security_egress.py", "test_envd_sleep.py",
              "test_node.py", "test_cluster_gateways.py", "test_snapshot_runsc.py",
              "test_sandbox_snapshot_faults.py", "test_pause_filesystem.py",
              "test_template_build.py", "test_reset.py", "test_e2b_sandbox.py",
              "test_cold_memory.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
