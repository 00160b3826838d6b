"""Template builds and what they buy: sandboxes of a built template restore with the
start command's service already running.

Measured on a node of its own, through the e2b SDK:
  - build: Template.build of a small template (a RUN, a COPY, ENV, WORKDIR and a
    Python HTTP server as the start command with wait_for_port), rebuilt each time
  - create until the service answers, interleaved:
      built:    Sandbox.create(<built template>) then one GET to the server
      baseline: the same server as a plain template's startCmd/readyCmd on the base
                rootfs; such a template's boot image (template_snapshots) is taken with
                the server running too, so this is the same kind of restore
      base:     Sandbox.create("base") alone (no service), for scale
Target: built p50 within 1.5x of the baseline's (a built template's snapshot also holds
what its build left in memory: the overlay's files, envd's heap).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
from e2b import Sandbox, Template, wait_for_port

from agentenv.testing import SHARED_HOME, Node, leaks
from common import summary, table, write

SERVER = "import http.server as h; h.ThreadingHTTPServer(('', 8000), h.SimpleHTTPRequestHandler)" \
         ".serve_forever()"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", type=int, default=3)
    ap.add_argument("--creates", type=int, default=10)
    args = ap.parse_args()

    prefix = "xbb"
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-tb-"))
    node = Node(home, prefix, "10.25.0.0/16", AENV_NET_POOL_LOW="4", AENV_NET_POOL_HIGH="8")
    node.start()
    os.environ.update(node.e2b_env())
    ctx = home / "ctx"
    ctx.mkdir()
    (ctx / "server.py").write_text(SERVER + "\n")
    # The baseline: the same service started at create by a plain template.
    plain = home / "templates" / "xbb-startcmd"
    plain.mkdir(parents=True)
    (plain / "rootfs").symlink_to(SHARED_HOME / "images" / "templates" / "base" / "rootfs")
    (plain / "template.json").write_text(json.dumps({
        "templateID": "xbb-startcmd", "startCmd": "cd /tmp && python3 -c \"" + SERVER + "\"",
        "readyCmd": "[ -n \"$(ss -Htuln sport = :8000)\" ]"}))
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    try:
        tpl = (Template(file_context_path=str(ctx)).from_template("base")
               .run_cmd("echo building").copy("server.py", "/home/user/srv/")
               .set_envs({"MODE": "bench"}).set_workdir("/home/user/srv")
               .set_start_cmd("python3 server.py", wait_for_port(8000)))
        for _ in range(args.builds):
            t0 = time.perf_counter()
            Template.build(tpl, "xbb-built", skip_cache=True)
            add("build (SDK, small template)", time.perf_counter() - t0)

        def serve(template: str, get: bool) -> float:
            t0 = time.perf_counter()
            sbx = Sandbox.create(template, timeout=120)
            if get:
                r = httpx.get(node.url + "/", headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                       "E2b-Sandbox-Port": "8000"}, timeout=30)
                assert r.status_code == 200, r.text
            took = time.perf_counter() - t0
            sbx.kill()
            return took

        for name in ("xbb-built", "xbb-startcmd", "base"):  # warm every path once
            serve(name, name != "base")
        for _ in range(args.creates):
            add("create until served: built template", serve("xbb-built", True))
            add("create until served: startCmd baseline", serve("xbb-startcmd", True))
            add("create: base (no service)", serve("base", False))
    finally:
        code = node.stop()
    left = leaks(prefix, home)
    rows = {k: summary(v) for k, v in samples.items()}
    built = rows["create until served: built template"]["p50_ms"]
    baseline = rows["create until served: startCmd baseline"]["p50_ms"]
    text = table("Template builds (e2b SDK, one node)", rows,
                 {"create until served: built template": "<= 1.5x baseline p50"})
    text += (f"\nbuilt {built} ms vs startCmd baseline {baseline} ms p50 "
             f"({baseline / built:.1f}x); node exit {code}, leaks {left or 'none'}\n")
    write("template_build", {"rows": rows, "node_exit": code, "leaks": left}, text)


if __name__ == "__main__":
    main()
