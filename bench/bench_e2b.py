"""The e2b SDK's cost over agentenv's native API, same node, same run.

Each operation is timed through the official e2b Python SDK and through the
native API (REST for create; envd's Connect-over-HTTP and /files through the
node's proxy, as bench_node.py does), samples interleaved so load drifts hit
both alike:
  - create until the sandbox answers (SDK: Sandbox.create; native: POST /sandboxes)
  - commands.run("true") (the SDK runs `bash -l -c true`; native runs the same argv)
  - a file write then read (1 MiB and 4 KiB)
Target: the SDK path costs at most 1.5x the native one (p50).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from agentenv.testing import Node, leaks
from bench_node import envd_headers, exec_native
from common import summary, table, write

MIB = 1 << 20
TARGET = 1.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=15)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--files", type=int, default=30)
    args = ap.parse_args()

    prefix = "aee"
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-e2b-"))
    node = Node(home, prefix, "10.21.0.0/16", AENV_MAX_SANDBOXES=str(2 * args.creates + 8),
                AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="16")
    node.start()
    os.environ.update(node.e2b_env())
    samples: dict[str, list[float]] = {}
    failures: list[str] = []

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            time.sleep(2)  # let the warm slot pool fill
            # Warm both paths once (imports, connection pools) before timing.
            Sandbox.create(template="base", timeout=60).kill()
            created: list[str] = []
            for _ in range(args.creates):
                t0 = time.perf_counter()
                sbx = Sandbox.create(template="base", timeout=600)
                add("create: SDK", time.perf_counter() - t0)
                created.append(sbx.sandbox_id)
                t0 = time.perf_counter()
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
                add("create: native", time.perf_counter() - t0)
                if r.status_code != 201:
                    failures.append(f"native create {r.status_code}")
                else:
                    created.append(r.json()["sandboxID"])
                # Keep the node's load steady: at most two live sandboxes here.
                for sid in created[:-2]:
                    api.delete(f"/sandboxes/{sid}")
                del created[:-2]

            sbx = Sandbox.connect(created[0])
            token = sbx._envd_access_token
            sid = sbx.sandbox_id
            argv = ["/bin/bash", "-l", "-c", "true"]
            for _ in range(3):
                sbx.commands.run("true")
                exec_native(http, sid, token, argv)
            for _ in range(args.execs):
                t0 = time.perf_counter()
                result = sbx.commands.run("true")
                add('commands.run("true"): SDK', time.perf_counter() - t0)
                t0 = time.perf_counter()
                code = exec_native(http, sid, token, argv)
                add('commands.run("true"): native', time.perf_counter() - t0)
                if result.exit_code != 0 or code != 0:
                    failures.append(f"exec exit {result.exit_code}/{code}")

            for size, label in ((MIB, "1 MiB"), (4096, "4 KiB")):
                payload = os.urandom(size)
                for i in range(args.files):
                    path = f"/home/user/bench-{label.replace(' ', '')}-{i}.bin"
                    t0 = time.perf_counter()
                    sbx.files.write(path, payload)
                    back = sbx.files.read(path, format="bytes")
                    add(f"file write+read {label}: SDK", time.perf_counter() - t0)
                    if bytes(back) != payload:
                        failures.append(f"SDK file round trip {label}")
                    headers = envd_headers(sid, token)
                    t0 = time.perf_counter()
                    w = http.post("/files", params={"path": path + ".n", "username": "user"},
                                  files={"file": ("bench.bin", payload)}, headers=headers)
                    g = http.get("/files", params={"path": path + ".n", "username": "user"},
                                 headers=headers)
                    add(f"file write+read {label}: native", time.perf_counter() - t0)
                    if w.status_code >= 300 or g.content != payload:
                        failures.append(f"native file round trip {label}: {w.status_code}")
            for s in created:
                api.delete(f"/sandboxes/{s}")
    finally:
        node.stop()
    left = leaks(prefix, home)

    rows = {name: summary(xs) for name, xs in samples.items()}
    ratios: dict[str, dict] = {}
    for name in list(rows):
        if name.endswith(": SDK"):
            op = name[: -len(": SDK")]
            native = rows.get(f"{op}: native")
            if native and native.get("p50_ms"):
                ratio = rows[name]["p50_ms"] / native["p50_ms"]
                ratios[op] = {"sdk_over_native_p50": round(ratio, 2),
                              "ok": ratio <= TARGET}
    rows["failures"] = {"count": len(failures)}
    targets = {f"{op}: SDK": f"<= {TARGET}x native p50" for op in ratios}
    text = table("e2b SDK vs native API, template base (same node, interleaved)", rows,
                 targets)
    text += "\n| operation | SDK p50 / native p50 | within 1.5x |\n| --- | --- | --- |\n"
    for op, r in ratios.items():
        text += f"| {op} | {r['sdk_over_native_p50']} | {'yes' if r['ok'] else 'no'} |\n"
    if failures:
        text += "\nFailures:\n" + "\n".join(f"- {f}" for f in failures[:20]) + "\n"
    if left:
        text += f"\nLeft behind: {left}\n"
    write("e2b", {"rows": rows, "ratios": ratios, "failures": failures, "leaks": left}, text)


if __name__ == "__main__":
    main()
