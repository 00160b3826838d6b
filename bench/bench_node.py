"""One node: cold create until envd answers, exec round trip, 1 MiB file round trip,
delete, and host memory per idle sandbox, for a run of N sandboxes.

Baseline in the same run: a bare `runsc do /bin/true`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from agentenv.testing import Node, leaks
from common import main_with_modes, summary, table, write

ENVD = "49983"
MIB = 1 << 20


def runsc_do_true() -> float:
    t0 = time.perf_counter()
    subprocess.run(["runsc", "--network=none", "do", "/bin/true"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def envd_headers(sid: str, token: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": ENVD, "X-Access-Token": token,
            "Authorization": "Basic " + base64.b64encode(b"user:").decode()}


def run_native(http: httpx.Client, sid: str, token: str, argv: list[str], user: str = "user",
               envs: dict[str, str] | None = None) -> tuple[int, str]:
    """Process.Start over the Connect protocol (JSON), through the node's proxy:
    (exit code, stdout)."""
    msg = json.dumps({"process": {"cmd": argv[0], "args": argv[1:],
                                  "envs": envs or {}}}).encode()
    body = b"\x00" + struct.pack(">I", len(msg)) + msg
    headers = {**envd_headers(sid, token), "Content-Type": "application/connect+json",
               "Connect-Protocol-Version": "1",
               "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}
    out, code = b"", -1
    with http.stream("POST", "/process.Process/Start", content=body, headers=headers) as r:
        r.raise_for_status()
        buf = r.read()
    while buf:
        flags, size = buf[0], struct.unpack(">I", buf[1:5])[0]
        frame, buf = json.loads(buf[5:5 + size] or b"{}"), buf[5 + size:]
        if flags & 0x02:
            if frame.get("error"):
                raise RuntimeError(frame["error"])
            break
        event = frame.get("event", {})
        if "data" in event and "stdout" in event["data"]:
            out += base64.b64decode(event["data"]["stdout"])
        if "end" in event:
            code = int(event["end"].get("exitCode", 0))
    return code, out.decode()


def exec_native(http: httpx.Client, sid: str, token: str, argv: list[str]) -> int:
    """A command's exit code (run_native)."""
    return run_native(http, sid, token, argv)[0]


def idle_memory(prefix: str, sid: str) -> tuple[int, int]:
    """(PSS of the sandbox's host processes, cgroup memory usage) in bytes."""
    procs = Path(f"/sys/fs/cgroup/memory/{prefix}/{sid}/cgroup.procs")
    pss = 0
    for pid in procs.read_text().split():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    usage = int(Path(f"/sys/fs/cgroup/memory/{prefix}/{sid}/memory.usage_in_bytes").read_text())
    return pss, usage


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=("mode `e2b`: the e2b SDK's cost over the native API, same node, same run "
                '(bench_node.py e2b --help)'))
    ap.add_argument("-n", "--sandboxes", type=int, default=40)
    ap.add_argument("--execs", type=int, default=50)
    args = ap.parse_args()

    prefix = "aeb"
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    # Cold means booted: no template images (bench_snapshots measures those).
    node = Node(home, prefix, "10.14.0.0/16", AENV_MAX_SANDBOXES=str(args.sandboxes + 8),
                AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="16", AENV_TEMPLATE_SNAPSHOTS="false")
    base = [runsc_do_true() for _ in range(10)]
    node.start()
    rows: dict[str, dict] = {"baseline: runsc do /bin/true": summary(base)}
    failures: list[str] = []
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            time.sleep(2)  # let the warm slot pool fill
            created, ids, tokens = [], [], {}
            for _ in range(args.sandboxes):
                t0 = time.perf_counter()
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 900})
                if r.status_code != 201:
                    failures.append(f"create: {r.status_code} {r.text[:200]}")
                    continue
                created.append(time.perf_counter() - t0)
                ids.append(r.json()["sandboxID"])
                tokens[ids[-1]] = r.json()["envdAccessToken"]
            rows["cold create until envd answers"] = summary(created)

            sid = ids[0]
            # `true` itself, and as the e2b SDK runs every command (a bash login shell).
            for label, argv in (("exec round trip of `true`", ["/bin/true"]),
                                ("exec of `bash -l -c true` (SDK style)",
                                 ["/bin/bash", "-l", "-c", "true"])):
                execs = []
                for _ in range(args.execs):
                    t0 = time.perf_counter()
                    code = exec_native(http, sid, tokens[sid], argv)
                    execs.append(time.perf_counter() - t0)
                    if code != 0:
                        failures.append(f"exec exit {code}")
                rows[label] = summary(execs)

            payload = bytes(range(256)) * (MIB // 256)
            files = []
            for i in range(20):
                path = f"/home/user/bench-{i}.bin"
                t0 = time.perf_counter()
                w = http.post("/files", params={"path": path, "username": "user"},
                              files={"file": ("bench.bin", payload)},
                              headers=envd_headers(sid, tokens[sid]))
                g = http.get("/files", params={"path": path, "username": "user"},
                             headers=envd_headers(sid, tokens[sid]))
                files.append(time.perf_counter() - t0)
                if w.status_code >= 300 or g.content != payload:
                    failures.append(f"file round trip: {w.status_code} {g.status_code}")
            rows["1 MiB write then read"] = summary(files)

            time.sleep(5)  # idle
            pss, usage = zip(*(idle_memory(prefix, s) for s in ids), strict=True)
            rows["host memory per idle sandbox (PSS)"] = {
                "p50_MiB": round(sorted(pss)[len(pss) // 2] / MIB, 1),
                "max_MiB": round(max(pss) / MIB, 1),
            }
            rows["host memory per idle sandbox (cgroup usage)"] = {
                "p50_MiB": round(sorted(usage)[len(usage) // 2] / MIB, 1),
                "max_MiB": round(max(usage) / MIB, 1),
            }
            alive = sum(1 for s in ids if api.get(f"/sandboxes/{s}").status_code == 200)
            rows[f"idle sandboxes running at once (of {args.sandboxes})"] = {"alive": alive}

            deletes = []
            for s in ids:
                t0 = time.perf_counter()
                r = api.delete(f"/sandboxes/{s}")
                deletes.append(time.perf_counter() - t0)
                if r.status_code != 204:
                    failures.append(f"delete {r.status_code}")
            rows["delete"] = summary(deletes)
    finally:
        node.stop()
    left = leaks(prefix, home)
    rows["failures"] = {"count": len(failures)}
    targets = {
        "cold create until envd answers": "p50 <= 600",
        "exec round trip of `true`": "p50 <= 30",
        "host memory per idle sandbox (PSS)": "<= 60 MiB",
        f"idle sandboxes running at once (of {args.sandboxes})": "40 without a failure",
    }
    text = table(f"Node: {args.sandboxes} sandboxes of template base", rows, targets)
    if failures:
        text += "\nFailures:\n" + "\n".join(f"- {f}" for f in failures[:20]) + "\n"
    if left:
        text += f"\nLeft behind: {left}\n"
    write("node", {"rows": rows, "failures": failures, "leaks": left}, text)


# -------------------- mode `e2b` (formerly bench_e2b.py)
# The e2b SDK's cost over agentenv's native API, same node, same run.
#
# Each operation is timed through the official e2b Python SDK and through the
# native API (REST for create; envd's Connect-over-HTTP and /files through the
# node's proxy, as bench_node.py does), samples interleaved so load drifts hit
# both alike:
#   - create until the sandbox answers (SDK: Sandbox.create; native: POST /sandboxes)
#   - commands.run("true") (the SDK runs `bash -l -c true`; native runs the same argv)
#   - a file write then read (1 MiB and 4 KiB)
# Target: the SDK path costs at most 1.5x the native one (p50).


TARGET = 1.5


def e2b_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="bench_node.py e2b",
        description="The e2b SDK's cost over the native API, same node, same run.")
    ap.add_argument("--creates", type=int, default=15)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--files", type=int, default=30)
    args = ap.parse_args(argv)

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
    main_with_modes(main, {"e2b": e2b_main})
