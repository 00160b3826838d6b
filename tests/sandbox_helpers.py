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


def counting(sbx: Sandbox) -> bool:
    """The counter loop advances (allowing for a loaded machine)."""
    first = count(sbx)
    for _ in range(50):
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
    sbx.commands.run("python3 /home/user/echo.py", background=True)
    wait_port(sbx, WS_ECHO_PORT)


def wait_port(sbx: Sandbox, port: int) -> None:
    """Until something inside the sandbox listens on ``port`` (10 s at most)."""
    sbx.commands.run(f"for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/{port}) "
                     f"2>/dev/null && exit 0; sleep 0.1; done; exit 1")
