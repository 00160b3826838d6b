"""Cross-node snapshot restores: a sandbox is snapshotted on node 1 and started from
that snapshot on node 1 (cached there) and on node 2 (which lacks it, and fetches
it from the shared repository). Bytes moved (read from the repository, from node
2's log) and create times, against the snapshot's size.

Two sandboxes: idle (what a template's sandbox holds) and one with 32 MiB of random
bytes written to /tmp (memory no other snapshot has).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

from agentenv.snapshot import Manifest
from agentenv.testing.cluster import Cluster
from common import write

MATERIALIZED = re.compile(r"materialized snapshot (\w+): (\d+) bytes \((\d+) from the "
                          r"repository\) in ([\d.]+)s")
MIB = 1 << 20


def fetched(log: Path, snapshot_id: str) -> tuple[int, float]:
    for line in reversed(log.read_text().splitlines()):
        m = MATERIALIZED.search(line)
        if m and m.group(1) == snapshot_id:
            return int(m.group(3)), float(m.group(4))
    return 0, 0.0


def create_from(cluster: Cluster, k: int, snapshot_id: str) -> float:
    with cluster.client(cluster.nodes[k - 1].url) as c:
        t0 = time.perf_counter()
        r = c.post("/sandboxes", json={"templateID": snapshot_id, "timeout": 60})
        took = time.perf_counter() - t0
        if r.status_code != 201:
            raise RuntimeError(f"create on node {k} answered {r.status_code}: {r.text}")
        c.delete(f"/sandboxes/{r.json()['sandboxID']}")
    return took


def trial(cluster: Cluster, blob_mib: int) -> dict:
    with cluster.client(cluster.nodes[0].url) as c:
        sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
        try:
            if blob_mib:
                from e2b import Sandbox

                Sandbox.connect(sid).commands.run(
                    f"head -c {blob_mib}M /dev/urandom > /tmp/blob", timeout=60)
            snap = c.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
        finally:
            c.delete(f"/sandboxes/{sid}")
    manifest = Manifest.from_json((cluster.repo / "manifests" / f"{snap}.json").read_bytes())
    try:
        same = create_from(cluster, 1, snap)
        cross = create_from(cluster, 2, snap)
        moved, fetch_s = fetched(cluster.nodes[1].log_path, snap)
    finally:
        with cluster.client(cluster.nodes[0].url) as c:
            c.delete(f"/snapshots/{snap}")
    return {"blob_mib": blob_mib, "snapshot_bytes": manifest.total_bytes,
            "fetched_bytes": moved, "fetch_s": fetch_s, "same_node_create_s": same,
            "cross_node_create_s": cross}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cross-"))
    cluster = Cluster(root, "xb", nodes=2, link_net=36, pool_nets=(37, 38))
    rows = []
    try:
        cluster.start()
        cluster.warm()
        from agentenv.testing import sdk_env

        with sdk_env(cluster.e2b_env()):
            for blob in (0, 32):
                rows += [trial(cluster, blob) for _ in range(args.trials)]
    finally:
        left = cluster.stop()
    text = f"### Cross-node restore of a snapshot {args.label}\n\n"
    text += ("| sandbox | snapshot MiB | fetched from repository MiB (median) | fetch s | "
             "create same node s | create other node s |\n| --- | --- | --- | --- | --- | --- |\n")
    for blob in (0, 32):
        rs = [r for r in rows if r["blob_mib"] == blob]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)
        text += (f"| {'idle' if not blob else f'+{blob} MiB random'} | "
                 f"{med('snapshot_bytes') / MIB:.1f} | {med('fetched_bytes') / MIB:.1f} | "
                 f"{med('fetch_s'):.2f} | {med('same_node_create_s'):.2f} | "
                 f"{med('cross_node_create_s'):.2f} |\n")
    write(f"cross_node{('_' + args.label) if args.label else ''}",
          {"rows": rows, "leaks": left}, text)
    print(text)


if __name__ == "__main__":
    main()
