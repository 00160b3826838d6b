"""Fuzz the node's HTTP API from its own OpenAPI document with schemathesis.

A real node; schemathesis generates requests for every documented operation
(examples at the edges of each schema, random valid and invalid data, and
stateful sequences that follow the document's links: create, then fork, pause,
snapshot, delete ...). What must hold: no 5xx (but a 503 saying the node is full:
tests/fuzz_hooks.py), every answer matches the
document (status codes, content types, the `{code, message}` error shape),
auth is enforced on every operation, undocumented methods get a 405 naming
the allowed ones. Afterwards the node still serves, never logged the API key
or an unhandled error, and leaves nothing behind.

Two checks stay off, both about how much the API accepts rather than what it
answers: `positive_data_acceptance` (query formats like `metadata=k=v&...` or
RFC 3339 times cannot be said in JSON Schema, so schema-valid strings are
rightly refused with a 400) and `negative_data_rejection` (pydantic's lax mode
takes `true` for an integer; refusing it would only break clients).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks

PREFIX = "afz"
CIDR = "10.41.0.0/16"
SCHEMATHESIS = Path(sys.executable).parent / "st"
HOOKS = Path(__file__).parent / "fuzz_hooks.py"
# Bounded for the suite's time: the coverage phase's cases dominate (5 examples made
# 1,808 cases in 14 s here, 15 made 2,331 in 45 s);
# AENV_FUZZ_EXAMPLES / AENV_FUZZ_SEED widen or replay a run.
EXAMPLES = os.environ.get("AENV_FUZZ_EXAMPLES", "5")


def _kill_all(api: httpx.Client) -> None:
    """Remove whatever the stateful phase created (running and paused sandboxes)."""
    listed = api.get("/v2/sandboxes", params=[("state", "running"), ("state", "paused")])
    assert listed.status_code == 200, listed.text
    for sbx in listed.json():
        r = api.delete(f"/sandboxes/{sbx['sandboxID']}")
        assert r.status_code in (204, 404), r.text
    for snap in api.get("/snapshots").json():
        assert api.delete(f"/snapshots/{snap['snapshotID']}").status_code in (204, 404)


def test_fuzz_api_from_openapi(tmp_path: Path) -> None:
    # A create beyond capacity waits its queue time, then a 429: kept short here.
    node = Node(tmp_path / "home", PREFIX, CIDR, AENV_MAX_SANDBOXES="8",
                AENV_ADMISSION_QUEUE_TIMEOUT_S="0.5")
    node.start()
    try:
        argv = [
            str(SCHEMATHESIS), "run", f"{node.url}/openapi.json",
            "-H", f"X-API-Key: {node.api_key}",
            "--checks", "all",
            "--exclude-checks",
            "not_a_server_error,positive_data_acceptance,negative_data_rejection",
            "--phases", "examples,coverage,fuzzing,stateful",
            "--max-examples", EXAMPLES,
            "--request-timeout", "120",
            # A template's first sandbox on a fresh node boots cold (the code
            # interpreter's kernels: ~11 s); later ones restore its boot image.
            "--max-response-time", "60",
            "--no-color",
        ]
        if os.environ.get("AENV_FUZZ_SEED"):
            argv += ["--seed", os.environ["AENV_FUZZ_SEED"]]
        t0 = time.monotonic()
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)})
        out = run.stdout + run.stderr
        (tmp_path / "schemathesis.txt").write_text(out)
        print(f"schemathesis: {time.monotonic() - t0:.0f}s\n" + out[-3000:])
        assert run.returncode == 0, out[-12000:]
        generated = re.search(r"(\d+) generated", out)
        assert generated and int(generated.group(1)) >= 200, "schemathesis ran too few cases"

        # Still serving, and a real sandbox still works end to end.
        with node.client() as api:
            assert api.get("/health").status_code == 200
            _kill_all(api)
            created = api.post("/sandboxes", json={"templateID": "base"})
            assert created.status_code == 201, created.text
            sid = created.json()["sandboxID"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
            assert api.get("/v2/sandboxes", params=[("state", "running"),
                                                    ("state", "paused")]).json() == []
        log = node.log_path.read_text(errors="replace")
        assert node.api_key not in log, "the API key was logged"
        assert "unhandled error" not in log and "Traceback" not in log, node.log_tail(80)
    finally:
        code = node.stop()
    assert code in (0, -15), node.log_tail()
    assert leaks(PREFIX, node.home) == []
