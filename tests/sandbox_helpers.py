"""Helpers shared by tests that check a sandbox's processes keep running."""

from __future__ import annotations

import time

from e2b import Sandbox

# A Python loop (no fork per tick, cheap on a loaded machine) writing a counter.
COUNTER = (
    "python3 -c 'import itertools, time\n"
    "for i in itertools.count():\n"
    "    open(\"/tmp/count\", \"w\").write(str(i)); time.sleep(0.05)'"
)


def count(sbx: Sandbox) -> int:
    return int(sbx.commands.run("cat /tmp/count 2>/dev/null || echo 0").stdout or 0)


def counting(sbx: Sandbox, within: float = 30) -> bool:
    """The counter loop advances within ``within`` seconds. The bound is time, not a
    number of looks: on a loaded machine each look (a command) takes longer, and a loop
    just restored with 15 siblings (test_fork) was seen to need more than 50 of them.
    It returns as soon as the count moves."""
    first = count(sbx)
    end = time.monotonic() + within
    while time.monotonic() < end:
        time.sleep(0.1)
        if count(sbx) > first:
            return True
    return False


WS_ECHO_PORT = 8765
_WS_ECHO = """
import asyncio, sys
sys.path.insert(0, "/home/user/lib")
from websockets.asyncio.server import serve

async def echo(ws):
    async for message in ws:
        await ws.send(message)

async def main():
    async with serve(echo, "0.0.0.0", PORT):
        await asyncio.Future()

asyncio.run(main())
""".replace("PORT", str(WS_ECHO_PORT))


def start_ws_echo(sbx: Sandbox) -> None:
    """A WebSocket echo server on WS_ECHO_PORT inside the sandbox. The template has no
    websockets package and tests have no internet: the pure-Python package is copied
    in from the test venv."""
    from pathlib import Path

    import websockets

    pkg = Path(websockets.__file__).parent
    sbx.files.write_files([
        {"path": f"/home/user/lib/websockets/{p.relative_to(pkg)}", "data": p.read_bytes()}
        for p in pkg.rglob("*.py")
    ])
    sbx.files.write("/home/user/echo.py", _WS_ECHO)
    # timeout=0: a command's timeout (the SDK's 60 s by default) ends a background one
    # too, and a module's tests may use the server for longer than that.
    sbx.commands.run("python3 /home/user/echo.py", background=True, timeout=0)
    wait_port(sbx, WS_ECHO_PORT)


def wait_port(sbx: Sandbox, port: int) -> None:
    """Until something inside the sandbox listens on ``port`` (10 s at most)."""
    sbx.commands.run(f"for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/{port}) "
                     f"2>/dev/null && exit 0; sleep 0.1; done; exit 1")


HOST_ECHO_LOG = "/tmp/hosts.log"
_HOST_ECHO = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        seen = {"host": self.headers.get("Host"),
                "forwarded": self.headers.get("X-Forwarded-Host")}
        with open(LOG, "a") as f:
            f.write(json.dumps(seen) + "\\n")
        body = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
""".replace("LOG", repr(HOST_ECHO_LOG))


def start_host_echo(sbx: Sandbox, port: int) -> None:
    """An HTTP server on ``port`` answering every GET with the Host and X-Forwarded-Host
    it received (JSON), each also appended to HOST_ECHO_LOG (WebSocket handshakes too)."""
    sbx.files.write("/home/user/host_echo.py", _HOST_ECHO)
    sbx.commands.run(f"python3 /home/user/host_echo.py {port}", background=True, timeout=0)
    wait_port(sbx, port)


def lose_pause_snapshot(node, api, sandbox_id: str) -> None:
    """Take a paused sandbox out of memory, then remove its committed pause snapshot
    underneath the node (the API refuses to: the paused sandbox needs it)."""
    import shutil
    import sqlite3

    assert api.post(f"/sandboxes/{sandbox_id}/evict").status_code == 204
    with sqlite3.connect(node.home / "db") as db:
        snap = db.execute("SELECT snapshot_id FROM sandboxes WHERE sandbox_id=?",
                          (sandbox_id,)).fetchone()[0]
    for _ in range(100):  # its background commit
        if api.get(f"/snapshots/{snap}").status_code == 200:
            break
        time.sleep(0.1)
    r = api.delete(f"/snapshots/{snap}")
    assert r.status_code == 409 and sandbox_id in r.json()["message"], r.text
    (node.home / "snapshots" / "manifests" / f"{snap}.json").unlink()
    # The commit turns its staged capture into the node's cache just after it answers:
    # what lands there a moment later goes too.
    for _ in range(10):
        for cached in (node.home / "cache" / "snapshots").glob(f"*{snap}*"):
            shutil.rmtree(cached, ignore_errors=True) if cached.is_dir() else cached.unlink()
        time.sleep(0.1)


def base_template_with(node, template_id: str, **fields) -> str:
    """A template of the node's own over the base template's rootfs, with other
    resources (``cpuCount``, ``memoryMB``, ``diskSizeMB``): written into the node's
    templates directory, as an operator would. Returns its ID."""
    import json

    from agentenv.testing import SHARED_HOME

    tdir = node.home / "templates" / template_id
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "template.json").write_text(json.dumps({"templateID": template_id, **fields}))
    if not (tdir / "rootfs").exists():
        (tdir / "rootfs").symlink_to(SHARED_HOME / "images" / "templates" / "base" / "rootfs")
    return template_id


def envd_processes(sbx: Sandbox) -> list[str]:
    """envd's own processes (pid 1 and any file workers): those started through the
    bundle's loader (argv[0] /.aenv/lib/...)."""
    return sbx.commands.run(
        "for p in /proc/[0-9]*; do [ \"$(head -c 11 $p/cmdline 2>/dev/null)\" = "
        "/.aenv/lib/ ] && echo ${p#/proc/}; done; true", user="root").stdout.split()
