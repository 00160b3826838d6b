"""What one heartbeat of a 300-sandbox node costs the scheduler: CPU, body bytes and
Redis commands per beat, for 0, 1 and 10 sandboxes changed per beat, before and after
heartbeats became diffs (``agentenv.cluster.beats``), against a real redis-server.

The scheduler's app runs in this process and each beat is handed to it as uvicorn
would (an ASGI request with the body whole): the CPU measured (this thread's) is
routing, the key check, reading and checking the body, the registry's work and the
answer; not the HTTP parsing (it grows with the body's bytes, given beside it), not
Redis's own. A tree without ``cluster/beats.py`` (before) gets the whole status every
beat, as its nodes send it; the other gets what a node's ``Beats`` sends (one beat in
FULL_CHECK_EVERY whole, at the registry's asking: counted in the mean, not the p50).

    python bench/bench_heartbeats.py --before /tmp/h31-before/src [--rounds 5 --beats 20]

runs rounds of both trees, interleaved (each a process with that tree first on
``sys.path``), and writes ``results/heartbeats``; ``--tree SRC`` runs one round of one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SANDBOXES = 300
CHANGES = (0, 1, 10)
API_KEY = "bench-" + "k" * 32


def _item(sid: str, step: int) -> dict[str, Any]:
    """A listing item as a real node sends it (E2B's ListedSandbox, ~400 bytes)."""
    return {"templateID": "base", "alias": "base", "sandboxID": sid, "clientID": "node-1",
            "startedAt": "2026-12-04T10:00:00.000000Z", "endAt": "2026-12-04T11:00:00.000000Z",
            "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 1024,
            "metadata": {"job": f"job-{sid[:4]}", "step": str(step), "owner": "rl-trainer"},
            "state": "running", "envdVersion": "0.2.0", "runID": None}


async def _post(app: Any, body: bytes) -> tuple[int, bytes]:
    """One POST /nodes/heartbeat to ``app`` as uvicorn hands it over."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/nodes/heartbeat",
             "raw_path": b"/nodes/heartbeat", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"scheduler"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"x-api-key", API_KEY.encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 9090)}
    given = asyncio.Event()
    answer: dict[str, Any] = {"chunks": []}

    async def receive() -> dict[str, Any]:
        if not given.is_set():
            given.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect
        return {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["chunks"].append(message.get("body", b""))

    await app(scope, receive, send)
    return answer["status"], b"".join(answer["chunks"])


async def _round(redis_url: str, beats: int) -> dict[str, Any]:
    from agentenv.cluster.common import NodeStatus, SandboxEntry
    from agentenv.cluster.scheduler import create_scheduler_app
    try:
        from agentenv.cluster.beats import Beats
    except ImportError:  # the tree before diffs: whole beats
        Beats = None  # type: ignore[assignment,misc]

    app = create_scheduler_app(redis_url, API_KEY)
    redis = app.state.registry.redis
    await redis.flushdb()
    node_beats = Beats() if Beats is not None else None
    steps = {f"sbx{i:04d}{'x' * 12}": 0 for i in range(SANDBOXES)}
    sids = list(steps)

    def body() -> tuple[bytes, Any, bool]:
        status = NodeStatus(
            node_id="node-1", url="http://10.0.0.1:8080", capacity=400, load=SANDBOXES,
            free_memory_mb=64_000, runtime_kind="gvisor", runtime_version="release-20251201",
            templates=["base", "python"], snapshots=[f"snap-{i}" for i in range(8)],
            sandboxes=[SandboxEntry(sid, "running", item=_item(sid, step))
                       for sid, step in steps.items()])
        if node_beats is None:
            return json.dumps(status.to_dict()).encode(), None, True
        raw, sent = node_beats.body(status)
        return json.dumps(raw).encode(), sent, bool(raw["full"])

    async def commands() -> int:
        return int((await redis.info("stats"))["total_commands_processed"])

    out: dict[str, Any] = {}
    turn = 0
    try:
        for changes in (None, *CHANGES):  # None: warm-up (the first beat, whole)
            samples: list[dict[str, Any]] = []
            for _ in range(beats if changes is not None else 5):
                for k in range(changes or 0):
                    sid = sids[(turn * 10 + k) % len(sids)]
                    steps[sid] += 1
                turn += 1
                raw, sent, full = body()
                before = await commands()
                cpu = time.thread_time()
                status, answer = await _post(app, raw)
                cpu = time.thread_time() - cpu
                count = await commands() - before - 1  # less the INFO itself
                assert status == 200, answer[:300]
                if node_beats is not None:
                    node_beats.answered(sent, json.loads(answer))
                samples.append({"cpu_ms": cpu * 1000, "bytes": len(raw), "commands": count,
                                "full": full})
            if changes is not None:
                out[str(changes)] = samples
    finally:
        await app.state.registry.close()
    return out


def _one(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--beats", type=int, default=20)
    parser.add_argument("--no-hiredis", action="store_true",
                        help="redis-py's own parser even where hiredis is installed")
    args = parser.parse_args(argv)
    if args.no_hiredis:
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # import hiredis fails
    print(json.dumps(asyncio.run(_round(args.redis_url, args.beats))))


def _run_tree(src: str, redis_url: str, beats: int, hiredis: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, __file__, "--tree", src, "--redis-url", redis_url,
                           "--beats", str(beats), *([] if hiredis else ["--no-hiredis"])],
                          env=env, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode:
        raise SystemExit(f"the round of {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(samples: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = [s["cpu_ms"] for s in samples]
    diffs = [s for s in samples if not s["full"]] or samples
    return {"n": len(samples), "cpu_p50_ms": round(statistics.median(cpu), 2),
            "cpu_mean_ms": round(statistics.fmean(cpu), 2),
            "bytes_p50": int(statistics.median(s["bytes"] for s in diffs)),
            "commands_p50": int(statistics.median(s["commands"] for s in diffs)),
            "full_beats": sum(s["full"] for s in samples),
            "full_cpu_p50_ms": round(statistics.median(
                [s["cpu_ms"] for s in samples if s["full"]]), 2)
            if any(s["full"] for s in samples) else None}


def main() -> None:
    if "--tree" in sys.argv:
        i = sys.argv.index("--tree")
        _one(sys.argv[1:i] + sys.argv[i + 2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the src/ of the tree before")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--beats", type=int, default=20, help="beats per round and change")
    parser.add_argument("--name", default="heartbeats")
    args = parser.parse_args()
    sys.path.insert(0, args.after)
    from agentenv.testing import start_redis

    # The tree before as it was (no hiredis), the tree after with and without it.
    trees = {"before": (args.before, False), "after": (args.after, True),
             "after, no hiredis": (args.after, False)}
    got: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_redis(lambda port: [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no"], Path(tmp) / "redis.log")
        try:
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for db, tree in enumerate(order):
                    url = f"redis://127.0.0.1:{port}/{db}"
                    src, hiredis = trees[tree]
                    for changes, samples in _run_tree(src, url, args.beats, hiredis).items():
                        got[tree].setdefault(changes, []).extend(samples)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(10)
    load = os.getloadavg()
    rows = {f"{tree}, {changes} changed": _row(samples)
            for changes in map(str, CHANGES) for tree, samples in
            ((t, got[t][changes]) for t in trees)}
    lines = [f"## Heartbeats: scheduler CPU per beat of a {SANDBOXES}-sandbox node", "",
             f"`python bench/bench_heartbeats.py --before SRC --rounds {args.rounds} --beats "
             f"{args.beats}`: {args.rounds} interleaved rounds per tree of {args.beats} beats "
             f"per row, a real redis-server; load average {load[0]:.1f} / {load[1]:.1f} "
             f"(1 / 5 min), {os.cpu_count()} cores. CPU: the scheduler's thread, from the "
             f"ASGI request to its answer (not HTTP parsing, not Redis). Bytes and Redis "
             f"commands: of a diff (after) or of the whole beat (before).", "",
             "| tree, sandboxes changed per beat | beats | CPU p50 ms | CPU mean ms | body "
             "bytes | Redis commands | full beats (their CPU p50 ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        full = f"{row['full_beats']}" + (f" ({row['full_cpu_p50_ms']})"
                                         if row["full_cpu_p50_ms"] is not None else "")
        lines.append(f"| {name} | {row['n']} | {row['cpu_p50_ms']} | {row['cpu_mean_ms']} | "
                     f"{row['bytes_p50']} | {row['commands_p50']} | {full} |")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import write
    write(args.name, {"rows": rows, "load": load, "rounds": args.rounds, "beats": args.beats,
                      "sandboxes": SANDBOXES}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
