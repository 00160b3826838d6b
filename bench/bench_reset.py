"""Reset in place (POST /sandboxes/{id}/reset) against kill + create from the snapshot,
on a real node, with bare `runsc restore` measured in the same run.

Run as root:  .venv/bin/python bench/bench_reset.py [-n 10]

One node "abr" (10.27.0.0/16; template boot images on, no warm pool; log level debug,
for the launch's step timings). A base sandbox starts a counter process and writes a
file, and is snapshotted once. Then n rounds, each measuring both ways back to that
snapshot (which goes first alternates, so both share the machine's noise):

- reset: the sandbox changes the file, then POST /sandboxes/{id}/reset; timed until
  the call answers, and until a command runs in it with the token it had before;
- kill + create: DELETE the sandbox the previous round created from the snapshot,
  then POST /sandboxes {"templateID": <snapshot>}; timed from the DELETE until the
  create answers, and until a command runs in the new sandbox (its new token).

Each round checks that the file is the snapshot's again and the counter runs.
Node-side timings come from its log: "reset X ... in N ms (...; old runtime destroyed
in M ms)" and the launch's "reset|restore of X: ..., reset|restore N ms, ..." (runsc
restore inside the node).
The bare baseline is bench_snapshots' (`sleep infinity`, root overlay in memory, no
network, no compression). Everything is removed at the end, even on errors.
Writes bench/results/reset.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from e2b import Sandbox

from agentenv.testing import Node, leaks, sdk_env
from bench_snapshots import (
    Failures,
    NodeLog,
    Tracker,
    Watch,
    bare_runsc,
    busy,
    run_in,
    until_command,
)
from common import finish, summary

COUNTER = ("python3 -c 'import itertools, time\nfor i in itertools.count():\n"
           "    open(\"/tmp/count\", \"w\").write(str(i)); time.sleep(0.05)'")
FILE = "/home/user/state.txt"
TARGETS = {
    "reset: API call": "p50 < kill + create",
    "reset: until a command runs (same token)": "p50 < kill + create",
}


def is_snapshot_state(node: Node, sid: str, token: str) -> bool:
    """The snapshot's file, and its counter process running."""
    return run_in(node, sid, token, ["sh", "-c", f'test "$(cat {FILE})" = start && '
                                     'pgrep -f "[i]tertools.count" >/dev/null']) == 0


def node_ms(log: NodeLog, pattern: str, offset: int) -> float | None:
    m = re.search(pattern, log.since(offset))
    return float(m.group(1)) if m else None


def bench(t: Tracker, log: NodeLog, n: int, rows: dict, raw: dict,
          failures: Failures) -> None:
    node, api = t.node, t.api
    _, sbx = t.create("base")
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    with sdk_env(node.e2b_env()):
        Sandbox.connect(sid).commands.run(COUNTER, background=True)
    run_in(node, sid, token, ["sh", "-c", f"echo start > {FILE}"])
    time.sleep(0.5)
    dt, snap = t.snapshot(sid, "bench-reset-start")
    raw["snapshot"] = {"seconds": round(dt, 3), "totalBytes": snap["totalBytes"]}
    snap_id = snap["snapshotID"]
    # The sandbox the next kill + create replaces (itself made from the snapshot).
    _, other = t.create(snap_id)
    samples: dict[str, list[float]] = {k: [] for k in (
        "reset_api", "reset_cmd", "reset_node", "reset_destroy", "reset_restore",
        "kc_delete", "kc_create", "kc_api", "kc_cmd", "kc_restore")}

    def one_reset() -> None:
        run_in(node, sid, token, ["sh", "-c", f"echo changed > {FILE}"])
        offset = log.offset()
        t0 = time.perf_counter()
        r = api.post(f"/sandboxes/{sid}/reset", json={"snapshotID": snap_id}, timeout=120)
        samples["reset_api"].append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"reset: {r.status_code} {r.text[:300]}")
        samples["reset_cmd"].append(until_command(node, sid, token, t0))
        if not is_snapshot_state(node, sid, token):
            failures.add(f"reset of {sid}: the file is not the snapshot's")
        line = log.wait_for(rf"reset {sid} to snapshot \S+ in (\d+) ms \([^;]*; old runtime "
                            rf"destroyed in (\d+) ms\)", offset, 5)
        if line:
            samples["reset_node"].append(float(line.group(1)) / 1000)
            samples["reset_destroy"].append(float(line.group(2)) / 1000)
        restore = node_ms(log, rf"reset of {sid}: .*?reset (\d+) ms", offset)
        if restore is not None:
            samples["reset_restore"].append(restore / 1000)

    def one_kill_create() -> None:
        nonlocal other
        offset = log.offset()
        t0 = time.perf_counter()
        t.delete(other["sandboxID"])
        t1 = time.perf_counter()
        create_s, other = t.create(snap_id)
        samples["kc_delete"].append(t1 - t0)
        samples["kc_create"].append(create_s)
        samples["kc_api"].append(time.perf_counter() - t0)
        new_sid, new_token = other["sandboxID"], other["envdAccessToken"]
        samples["kc_cmd"].append(until_command(node, new_sid, new_token, t0))
        if not is_snapshot_state(node, new_sid, new_token):
            failures.add(f"create from the snapshot ({new_sid}): the file is not the snapshot's")
        restore = node_ms(log, rf"restore of {new_sid}: .*?restore (\d+) ms", offset)
        if restore is not None:
            samples["kc_restore"].append(restore / 1000)

    for i in range(n):
        for step in ((one_reset, one_kill_create) if i % 2 == 0
                     else (one_kill_create, one_reset)):
            try:
                step()
            except Exception as exc:
                failures.add(f"round {i} {step.__name__}: {type(exc).__name__}: {exc}")
    raw["samples_s"] = {k: [round(x, 4) for x in v] for k, v in samples.items()}
    rows["reset: API call"] = summary(samples["reset_api"])
    rows["reset: until a command runs (same token)"] = summary(samples["reset_cmd"])
    rows["reset, node-side (node log)"] = summary(samples["reset_node"])
    rows["reset, node-side: destroy of the old runtime"] = summary(samples["reset_destroy"])
    rows["reset, node-side: runsc restore (launch step)"] = summary(samples["reset_restore"])
    rows["kill + create: DELETE call"] = summary(samples["kc_delete"])
    rows["kill + create: create-from-snapshot call"] = summary(samples["kc_create"])
    rows["kill + create: both API calls"] = summary(samples["kc_api"])
    rows["kill + create: until a command runs (new token)"] = summary(samples["kc_cmd"])
    rows["kill + create, node-side: runsc restore (launch step)"] = summary(
        samples["kc_restore"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10, help="rounds (each: one reset, one kill + create)")
    ap.add_argument("--keep", action="store_true", help="keep the node's home")
    ap.add_argument("--wait-for-tests", type=float, default=600,
                    help="seconds to wait for a running pytest to finish (2 cores)")
    args = ap.parse_args()
    end = time.monotonic() + args.wait_for_tests
    while busy() and time.monotonic() < end:
        time.sleep(5)
    rows: dict[str, dict] = {}
    raw: dict = {}
    failures = Failures()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-reset-"))
    node = Node(work / "home", "abr", "10.27.0.0/16", AENV_MAX_SANDBOXES="16",
                AENV_NET_POOL_LOW="4", AENV_NET_POOL_HIGH="8", AENV_WARM_POOL_SIZE="0",
                AENV_LOG_LEVEL="debug")
    left: list[str] = []
    watch = Watch()
    watch.start()
    try:
        watch.enter("bare runsc")
        try:
            bare_runsc(work / "bare", args.n, rows, raw)
        except Exception as exc:
            failures.add(f"bare runsc: {exc}")
        for k in [k for k in rows if "checkpoint" in k]:
            rows.pop(k)  # only the restore is this benchmark's baseline
        watch.enter("reset vs kill + create")
        node.start()
        log = NodeLog(node)
        with node.client() as api:
            t = Tracker(node, api)
            try:
                time.sleep(2)  # let the slot pool fill
                bench(t, log, args.n, rows, raw, failures)
            except Exception as exc:
                failures.add(f"bench: {type(exc).__name__}: {exc}")
            finally:
                t.cleanup(failures)
        node.stop()
    finally:
        watch.stop()
        with contextlib.suppress(Exception):
            node.stop()
        left = leaks("abr", node.home)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows["failures"] = {"count": len(failures)}
    reset_p50 = rows.get("reset: until a command runs (same token)", {}).get("p50_ms")
    kc_p50 = rows.get("kill + create: until a command runs (new token)", {}).get("p50_ms")
    if reset_p50 and kc_p50:
        rows["reset / (kill + create), until a command runs"] = {
            "p50_ratio": round(reset_p50 / kc_p50, 2), "saved_ms": round(kc_p50 - reset_p50, 1)}
    finish("reset", "Reset in place vs kill + create from the snapshot (template base, 512 MiB)",
           rows, TARGETS,
           f"\nn = samples: {args.n} rounds, each one reset and one kill + create (alternating "
           "which goes first), back to one snapshot of a base sandbox running a counter "
           f"process (snapshot: {raw.get('snapshot')}). Node abr: template boot images on, "
           "no warm pool. Bare runsc baseline measured in the same run: `sleep infinity`, "
           "overlay root in memory, no network, no compression (its image is far smaller "
           "than the sandbox's).\n", watch.overlapped, failures, left, raw)
    return 1 if failures or left else 0


if __name__ == "__main__":
    sys.exit(main())
