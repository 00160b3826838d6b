"""Template builds on a node of their own: a build a crash interrupted is failed at
restart and its sandbox removed; a ready check that never passes fails the build."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from agentenv.testing import Node, leaks

PREFIX = f"xr{os.getpid() % 1000}"
CIDR = "10.24.0.0/16"


def _status(client: httpx.Client, tid: str, bid: str) -> dict:
    return client.get(f"/templates/{tid}/builds/{bid}/status").json()


def test_crash_fails_the_build_and_ready_check_times_out(tmp_path: Path) -> None:
    # With a warm pool: sandboxes of a built template come from it too.
    node = Node(tmp_path / "home", PREFIX, CIDR, AENV_BUILD_READY_TIMEOUT="3",
                AENV_WARM_POOL_SIZE="1")
    node.start()
    try:
        api = {"api_key": node.api_key, "api_url": node.url}
        small = (Template().from_template("base").run_cmd("echo kept > /home/user/kept.txt")
                 .set_envs({"KEPT": "yes"}).set_workdir("/tmp").set_user("root"))
        built = Template.build(small, "xbt-kept", cpu_count=1, memory_mb=768, **api)
        slow = Template().from_template("base").run_cmd("echo working; sleep 600")
        info = Template.build_in_background(slow, "xbt-crash", **api)
        with node.client() as c:
            end = time.monotonic() + 60
            while not any(e["message"] == "working" for e in
                          _status(c, info.template_id, info.build_id)["logEntries"]):
                assert time.monotonic() < end, node.log_tail()
                time.sleep(0.2)
        node.kill9()
        node.start()
        with node.client() as c:
            status = _status(c, info.template_id, info.build_id)
            assert status["status"] == "error"
            assert "interrupted by a node restart" in status["reason"]["message"]
            assert c.get("/sandboxes").json() == []
            # What was built before the crash is still there, with its resources.
            meta = c.get(f"/templates/{built.template_id}").json()
            assert (meta["cpuCount"], meta["memoryMB"]) == (1, 768)
            ids = []
            for _ in range(3):  # the first restores the snapshot, later ones are pooled
                sbx = Sandbox.create("xbt-kept", sandbox_url=node.url, **api)
                ids.append(sbx.sandbox_id)
                try:
                    out = sbx.commands.run("cat /home/user/kept.txt; echo $KEPT; whoami; pwd")
                    assert out.stdout == "kept\nyes\nroot\n/tmp\n"
                    info = sbx.get_info()
                    assert (info.cpu_count, info.memory_mb) == (1, 768)
                    assert "aenv.build" not in (info.metadata or {})
                finally:
                    sbx.kill()
                time.sleep(1)
            pooled = [i for i in ids if f"created {i} in" in node.log_tail(300)
                      and "(from the warm pool)" in node.log_tail(300).split(f"created {i}")[1]
                      .splitlines()[0]]
            assert pooled, node.log_tail(60)

            never = (Template().from_template("base")
                     .set_start_cmd("sleep 1000", "test -f /tmp/never-there"))
            with pytest.raises(BuildException, match=r"ready check did not pass within 3s"):
                Template.build(never, "xbt-neverready", **api)
            assert c.get("/sandboxes").json() == []
            assert c.get("/templates/xbt-neverready").status_code == 404
    finally:
        code = node.stop()
    assert code in (0, -15), node.log_tail()
    assert leaks(PREFIX, node.home) == []
