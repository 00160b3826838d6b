"""Trace: where a restored sandbox's first command spends its extra time.

For a fork child and for a resume after eviction (its commit landed), a health
check and three `/bin/true` commands (envd's Process.Start), either through the
node's proxy or straight to envd at the slot's address (no node in the path).
If the first command is slower straight to envd too, the extra is inside the
sandbox, not in the node.

Run as root:  cd bench && ../.venv/bin/python trace_first_command.py [rounds] [net]
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks
from bench_node import envd_headers, run_native


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def probe(http: httpx.Client, sid: str, tok: str) -> list[tuple[str, float]]:
    """A health check, then three commands, each timed."""
    out = [("health", timed(lambda: http.get(
        "/health", headers=envd_headers(sid, tok)).raise_for_status()))]
    for i in (1, 2, 3):
        out.append((f"command {i}", timed(lambda: run_native(http, sid, tok, ["/bin/true"]))))
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    net = int(sys.argv[2]) if len(sys.argv) > 2 else 206
    work = Path(tempfile.mkdtemp(prefix="trace-first-"))
    node = Node(work / "home", f"tf{uuid.uuid4().hex[:2]}", f"10.{net}.0.0/16",
                AENV_IDLE_FREEZE_S="0")
    node.start()
    rows: dict[tuple[str, str], list[float]] = {}
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as proxy:
            src = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()
            for _ in range(3):
                run_native(proxy, src["sandboxID"], src["envdAccessToken"], ["/bin/true"])
            for _ in range(rounds):
                for kind in ("fork child", "evicted resume"):
                    for path in ("through the node", "straight to envd"):
                        if kind == "fork child":
                            c = api.post(f"/sandboxes/{src['sandboxID']}/fork",
                                         json={"count": 1}).json()[0]["sandbox"]
                        else:
                            c = api.post("/sandboxes", json={"templateID": "base",
                                                             "timeout": 600}).json()
                            run_native(proxy, c["sandboxID"], c["envdAccessToken"], ["/bin/true"])
                            api.post(f"/sandboxes/{c['sandboxID']}/pause").raise_for_status()
                            api.post(f"/sandboxes/{c['sandboxID']}/evict").raise_for_status()
                            time.sleep(2)  # its commit lands
                            api.post(f"/sandboxes/{c['sandboxID']}/connect",
                                     json={"timeout": 600}).raise_for_status()
                        sid, tok = c["sandboxID"], c["envdAccessToken"]
                        db = sqlite3.connect(node.home / "db")
                        address = db.execute("select slot_address from sandboxes where "
                                             "sandbox_id=?", (sid,)).fetchone()[0]
                        db.close()
                        with httpx.Client(base_url=f"http://{address}:49983",
                                          timeout=60) as direct:
                            http = proxy if path == "through the node" else direct
                            for name, ms in probe(http, sid, tok):
                                rows.setdefault((f"{kind}, {path}", name), []).append(ms)
                        api.delete(f"/sandboxes/{sid}")
            api.delete(f"/sandboxes/{src['sandboxID']}")
    finally:
        node.stop()
    for (k, name), v in rows.items():
        print(f"{k:36s} {name:10s} p50 {statistics.median(v):6.1f} ms  {[round(x) for x in v]}")
    print("left behind:", leaks(node.prefix, node.home))


if __name__ == "__main__":
    main()
