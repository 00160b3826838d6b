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
# pytest-xdist each of the two workers has a session node, in its own half.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
TEST_CIDR = free_cidr(50 + 20 * (int(WORKER) % 2 if WORKER.isdigit() else 0), 20, os.getpid())


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


# The files that take longest (seconds of one worker, summed from --junitxml, in a run
# of the whole parallel part on this 2-core machine), started first: `make test` hands
# whole files to two workers, and a long file left for last makes the run as long as
# it (longest first keeps the tail short). Every `make test` log ends with the slowest
# steps (--durations=25): re-rank from there when this drifts. (test_cluster's place is
# the last CI run's: its cluster did not come up in this one.)
SLOW_FILES = ("test_cli.py", "test_envd_dormant.py", "test_sandbox_snapshots.py",
              "test_crash_safety.py", "test_security_memory.py", "test_idle_freeze.py",
              "test_images_node.py", "test_cluster.py", "test_code_interpreter_parity.py",
              "test_template_build_cli.py", "test_fork.py", "test_e2b_js.py",
              "test_images_cleanup.py", "test_rl_client.py", "test_e2b_code_interpreter.py",
              "test_deploy_compose.py", "test_snapshot_store.py", "test_cluster_gateways.py",
              "test_security_round3.py", "test_crash.py", "test_images_lazy.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
