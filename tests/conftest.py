"""Shared fixtures: a real node server (runsc, netns, envd) for the whole session."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx._transports.default as httpx_transports
import pytest

from agentenv.testing import Node, free_cidr, leaks, sdk_env, start_redis

# httpx builds a TLS context for every client it makes (the CA bundle parsed: 20-50
# ms of CPU), and a module-level httpx.get is a client: the tests' polls of plain-HTTP
# loopback servers paid it thousands of times (py-spy: half of test_fork.py's own
# CPU). In the tests' processes, clients that ask for the default verification share
# one context; any other (a CA file, a client certificate) is built as httpx does.
_default_tls = httpx.create_ssl_context()
_create_ssl_context = httpx_transports.create_ssl_context


def _shared_ssl_context(verify: object = True, cert: object = None, trust_env: bool = True
                        ) -> object:
    if verify is True and cert is None and trust_env:
        return _default_tls
    return _create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)


httpx_transports.create_ssl_context = _shared_ssl_context

# Per session, so that two test runs on one machine never take each other's
# slots for crash leftovers (each node removes unknown slots of its prefix).
TEST_PREFIX = f"t{os.getpid() % 46656:03x}"
# 10.50-89 is the session nodes' alone: the nodes single test files start use
# fixed or per-file ranges (10.13-44, 10.120-249); a session node sharing one with
# them (as 10.100-199 could) broke their creates on the host's routes. Under
# pytest-xdist each worker has a session node, in a share of its own of that range
# (a half each of two workers, a third of three, a quarter of four).
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


# The files that take longest, longest first (seconds of one worker, from a run's
# AENV_TEST_TIMELINE), handed out in this order (--no-loadscope-reorder in
# scripts/test-suite.sh: xdist's own order hands out the files with the most tests
# first, which left the two heaviest, one test each, for the end, side by side while
# the rest of the machine idled). The files that wait for a template built beside the
# tests (needs_build) are not first: from scratch those builds take 2-3 minutes.
SLOW_FILES = ("test_envd_dormant.py", "test_cluster.py", "test_crash_safety.py",
              "test_deploy_compose.py", "test_crash.py", "test_e2b_js.py",
              "test_idle_freeze.py", "test_code_interpreter_parity.py", "test_fork.py",
              "test_template_build_cli.py", "test_sandbox_snapshots.py", "test_cli.py",
              "test_rl_client.py", "test_images_cleanup.py", "test_security_round3.py",
              "test_e2b_code_interpreter.py", "test_diff.py", "test_template_build_restart.py",
              "test_security_memory.py", "test_snapshot_crash.py", "test_reset.py",
              "test_pause_filesystem.py", "test_images_estargz.py", "test_images_lazy.py",
              "test_cold_memory.py", "test_cluster_gateways.py", "test_images_create.py",
              "test_fuzz_api.py", "test_template_start.py", "test_cluster_room.py",
              "test_cluster_sim.py", "test_snapshot_store.py", "test_images_node.py",
              "test_snapshot_image_gc.py", "test_fs_reset.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


# `make test` builds the code-interpreter template and the deployment base beside the
# parallel part (scripts/test-suite.sh): a test marked needs_build("name") waits for
# that build to end, and fails with its log if it failed. Run any other way (no such
# build under way), the mark waits for nothing.
BUILD_WAIT_S = 1800.0


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    pending = os.environ.get("AENV_TEST_PENDING_BUILDS")
    if not pending:
        return
    for mark in item.iter_markers("needs_build"):
        name = mark.args[0]
        log, rc = Path(pending) / f"{name}.log", Path(pending) / f"{name}.rc"
        if not log.exists():
            continue
        deadline = time.monotonic() + BUILD_WAIT_S
        while not rc.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"building {name} still under way after {BUILD_WAIT_S:.0f} s")
            time.sleep(1.0)
        if rc.read_text().strip() != "0":
            pytest.fail(f"building {name} failed:\n{log.read_text()[-4000:]}")


# AENV_TEST_TIMELINE=<file>: each test phase's worker, start and end appended as a JSON
# line, to see where a run's time goes (which files overlap, where a worker idles).
_TIMELINE = os.environ.get("AENV_TEST_TIMELINE")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Written by one process: xdist's controller gets every worker's reports (with
    # the worker as report.node); a run without workers writes its own.
    if not _TIMELINE or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    line = json.dumps({"w": worker, "id": report.nodeid, "phase": report.when,
                       "start": report.start, "stop": report.stop, "outcome": report.outcome})
    with open(_TIMELINE, "a") as f:
        f.write(line + "\n")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of the test module's own, on loopback, kept in memory only."""
    proc, port = start_redis(lambda port: [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no"], tmp_path_factory.mktemp("redis") / "redis.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
