"""The official e2b JavaScript SDKs (npm `e2b`, `@e2b/code-interpreter`, pinned in
tests/js/package.json) against the session's node, with node's test runner."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agentenv.testing import Node

pytestmark = pytest.mark.needs_build("code-interpreter")

JS = Path(__file__).resolve().parent / "js"


def test_js_sdk(node: Node) -> None:
    node_bin = shutil.which("node")
    if node_bin is None or not (JS / "node_modules" / "e2b").is_dir():
        pytest.fail("node and tests/js/node_modules are needed: run `make test` (its set-up "
                    "runs `npm ci` in tests/js)")
    env = {**os.environ, **node.e2b_env(), "AENV_NODE_PORT": str(node.port),
           "NODE_NO_WARNINGS": "1"}
    files = sorted(str(p) for p in JS.glob("*.test.mjs"))
    # Three files at a time: they wait on sandboxes far more than they compute.
    proc = subprocess.run([node_bin, "--test", "--test-concurrency=3", "--test-reporter=spec",
                           *files], cwd=JS,
                          env=env, capture_output=True, text=True, timeout=420)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
