"""Snapshot store: commit throughput, bytes stored, materialize cold vs cached.

Run as root:  .venv/bin/python bench/bench_snapshot_store.py [--mib 256] [--n 20]

Payload: REAL gVisor checkpoint images. A runsc sandbox (overlay root in memory,
no network, its own --root under a temp dir) holds --mib MiB of random data in
a Python process; it is checkpointed (leave-running, no compression), 1 MiB is
written inside it, and it is checkpointed again. Both captures are committed to
each backend: posix_fs in a temp dir and oss on moto's S3 server on 127.0.0.1.
Also compares chunking strategies on the same two images. Writes
bench/results/snapshot_store.{json,md}. Everything it creates is removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import blake3
import boto3
from moto.server import ThreadedMotoServer
from pyfastcdc import FastCDC

from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.testing.checkpoints import two_checkpoints
from common import summary, table, write

ROOTFS = Path(os.environ.get("AENV_HOME", "/var/lib/aenv")) / "images/templates/base/rootfs"
MiB = 1 << 20


def capture(work: Path, mib: int) -> tuple[Path, Path]:
    return two_checkpoints(work, ROOTFS, mib)


def chunk_digests(image_dir: Path, strategy: str) -> list[tuple[str, int]]:
    out = []
    for f in sorted(image_dir.iterdir()):
        data = f.read_bytes()
        if strategy.startswith("fixed"):
            size = int(strategy.split("-")[1].rstrip("K")) * 1024
            pieces = (data[i:i + size] for i in range(0, len(data), size))
        else:
            avg = int(strategy.split("-")[1].rstrip("K")) * 1024
            pieces = (bytes(c.data) for c in FastCDC(avg).cut_buf(data))
        out.extend((blake3.blake3(p).hexdigest(), len(p)) for p in pieces)
    return out


def compare_chunking(first: Path, second: Path) -> dict:
    rows = {}
    for strategy in ("fixed-4K", "fixed-64K", "fixed-1024K", "cdc-16K", "cdc-64K", "cdc-256K"):
        a = chunk_digests(first, strategy)
        b = chunk_digests(second, strategy)
        have = {d for d, _ in a}
        new_bytes, seen = 0, set()
        for d, n in b:
            if d not in have and d not in seen:
                seen.add(d)
                new_bytes += n
        total = sum(n for _, n in b)
        rows[strategy] = {"chunks": len(b), "new_bytes": new_bytes,
                          "new_pct": round(100 * new_bytes / total, 2)}
    return rows


def bench_backend(name: str, config: dict, images: tuple[Path, Path], work: Path,
                  n: int) -> dict:
    home = work / f"home-{name}"
    store = SnapshotStore(open_repository(config), home / "cache", home / "staging")
    out: dict = {}
    for sid, src, parent in (("full", images[0], None), ("after-1mib", images[1], "full")):
        staging = store.new_staging(sid)
        for f in src.iterdir():
            shutil.copyfile(f, staging / f.name)
        os.sync()
        md = {"source_sandbox_id": "bench", "template_id": "base"}
        if parent:
            md["parent_snapshot_id"] = parent
        t0 = time.perf_counter()
        m = store.commit(sid, staging, md)
        dt = time.perf_counter() - t0
        out[f"commit {sid}"] = {"seconds": round(dt, 3),
                                "MB_per_s": round(m.total_bytes / dt / 1e6, 1),
                                "total_bytes": m.total_bytes, "stored_bytes": m.stored_bytes}
    out["after-1mib stored / full stored %"] = round(
        100 * out["commit after-1mib"]["stored_bytes"] / out["commit full"]["stored_bytes"], 2)
    # Cold: another node's empty cache; every chunk comes from the repository.
    cold = []
    for i in range(2):
        node = SnapshotStore(store.repo, home / f"cold{i}", home / "staging")
        t0 = time.perf_counter()
        node.materialize("full")
        cold.append(time.perf_counter() - t0)
        shutil.rmtree(home / f"cold{i}")
    out["materialize full, cold"] = summary(cold)
    # Incremental cold: the parent is cached here, only changed chunks are downloaded.
    node = SnapshotStore(store.repo, home / "inc", home / "staging")
    node.materialize("full")
    t0 = time.perf_counter()
    node.materialize("after-1mib")
    out["materialize after-1mib, parent cached"] = summary([time.perf_counter() - t0])
    cached = []
    for _ in range(n):
        t0 = time.perf_counter()
        store.materialize("full")
        cached.append(time.perf_counter() - t0)
    out["materialize full, cached"] = summary(cached)
    t0 = time.perf_counter()
    store.delete("full")
    stats = store.gc()
    out["delete + gc"] = {"seconds": round(time.perf_counter() - t0, 3),
                          "deleted_chunks": stats["deleted_chunks"],
                          "deleted_bytes": stats["deleted_bytes"]}
    store.repo.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="random MiB held in the sandbox")
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (runsc)", file=sys.stderr)
        return 1
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    work = Path(tempfile.mkdtemp(prefix="snapbench-"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        t0 = time.perf_counter()
        images = capture(work / "runsc", args.mib)
        sizes = {f.name: f.stat().st_size for f in images[0].iterdir()}
        print(f"captured in {time.perf_counter() - t0:.1f}s: {sizes}", flush=True)
        chunking = compare_chunking(*images)
        port = server.get_host_and_port()[1]
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket="snapbench")
        configs = {
            "posix_fs": {"backend": "posix_fs", "path": str(work / "repo")},
            "oss (moto)": {"backend": "oss", "endpoint_url": f"http://127.0.0.1:{port}",
                           "bucket": "snapbench", "prefix": "b", "region": "us-east-1",
                           "access_key_id": "bench", "secret_access_key": "bench"},
        }
        results = {name: bench_backend(name.split()[0], cfg, images, work, args.n)
                   for name, cfg in configs.items()}
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    text = f"## Snapshot store ({args.mib} MiB random in the sandbox; real runsc images)\n\n"
    text += "### Chunking on the two images (bytes of the second not in the first)\n\n"
    text += "| strategy | chunks | new bytes | new % |\n| --- | --- | --- | --- |\n"
    for k, v in chunking.items():
        text += f"| {k} | {v['chunks']} | {v['new_bytes']} | {v['new_pct']} |\n"
    text += "\n"
    for name, rows in results.items():
        flat = {k: (v if isinstance(v, dict) else {"value": v}) for k, v in rows.items()}
        text += table(f"{name}", flat,
                      {"after-1mib stored / full stored %": "<= 5"}) + "\n"
    write("snapshot_store", {"mib": args.mib, "image_sizes": sizes, "chunking": chunking,
                             "backends": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
