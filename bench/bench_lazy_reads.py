"""Reads inside a sandbox through a lazily loaded layer against unpacked layers.

The base rootfs is converted once into a posix_fs repository (one layer); a layer
server (``--server``, a module run as ``python -m MODULE INDEX MOUNT CHUNKS``, so an
older server can be measured beside the current one) mounts it, and a read-only host
overlay stacks it as the node does. In a bare runsc sandbox (``--overlay2=root:memory``,
no network) every file below ``/usr/lib/python3.11`` is read three times (cold, then
hot), then ``/usr/bin/git`` ten times; then ``--rounds`` new sandboxes of each mount do
the same with the page cache warm (the RL case: many sandboxes of one image),
interleaved with the other roots. The unpacked rootfs under the same overlay is the
floor (its page cache is not dropped first: that stalls a loaded machine). The
server's request counts show what reached it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

from agentenv.images.convert import convert_layer
from agentenv.snapshot.backends import open_repository
from agentenv.testing import SHARED_HOME
from agentenv.testing.checkpoints import bare_sandbox
from agentenv.testing.oci_registry import tar_tree
from common import table, write

BASE = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
WALK = r"""import os, time
def run():
    t, n = time.perf_counter(), 0
    for d, _, fs in os.walk('/usr/lib/python3.11'):
        for f in fs:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, 'rb') as h: n += len(h.read())
    return time.perf_counter() - t, n
a, n = run(); b, _ = run(); c, _ = run()
open('/usr/bin/git', 'rb').read()
t = time.perf_counter()
for _ in range(10):
    with open('/usr/bin/git', 'rb') as h: m = len(h.read())
print(a, b, c, n, 10 * m / 1e6 / (time.perf_counter() - t))
"""


def overlay(work: Path, lower: Path, name: str) -> Path:
    point, empty = work / name, work / "empty"
    point.mkdir()
    empty.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lower}:{empty}",
                    str(point)], check=True)
    return point


def walk_in_sandbox(work: Path, rootfs: Path) -> dict:
    box = work / f"rs-{uuid.uuid4().hex[:6]}"
    base, bundle = bare_sandbox(box, rootfs, ["/usr/bin/python3", "-c", WALK])
    cid = f"lzr-{uuid.uuid4().hex[:6]}"
    try:
        out = subprocess.run([*base, "run", "--bundle", str(bundle), cid], capture_output=True,
                             text=True, timeout=600)
    finally:
        subprocess.run([*base, "delete", "--force", cid], capture_output=True)
        shutil.rmtree(box, ignore_errors=True)
    a, b, c, n, big = out.stdout.split()
    return {"walk1_s": round(float(a), 3), "walk2_s": round(float(b), 3),
            "walk3_s": round(float(c), 3), "files_MB": round(int(n) / 1e6, 1),
            "big_file_MB_per_s": round(float(big))}


class Served:
    """A layer server (``python -m MODULE``) mounting the converted layer, under a
    read-only host overlay; its request counts once unmounted."""

    def __init__(self, work: Path, index: Path, repo: Path, server: str):
        self.server = server
        self.mnt, chunks, self.log = (work / f"mnt-{server}", work / f"chunks-{server}",
                                      work / f"{server}.log")
        self.mnt.mkdir()
        chunks.mkdir()
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", server, str(index),
                                          str(self.mnt), str(chunks)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"backend": "posix_fs", "path": str(repo)}).encode())
        self.proc.stdin.close()
        assert self.proc.stdout.readline().strip() == b"ready"
        self.rootfs = overlay(work, self.mnt, f"ovl-{server}")

    def close(self) -> str:
        subprocess.run(["umount", str(self.rootfs)])
        subprocess.run(["umount", str(self.mnt)])
        self.proc.wait(30)
        return self.log.read_text().rsplit("requests: ", 1)[-1].strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="warm sandboxes per root")
    ap.add_argument("--server", action="append",
                    help="layer server module(s) to measure (default: the current one)")
    args = ap.parse_args()
    servers = args.server or ["agentenv.images.lazyfs"]
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-lr-"))
    rows: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    try:
        tar = tar_tree(BASE, work / "base.tar").read_bytes()
        layer = hashlib.sha256(tar).hexdigest()
        repo = work / "repo"
        t0 = time.perf_counter()
        index = convert_layer((tar[i:i + (1 << 20)] for i in range(0, len(tar), 1 << 20)),
                              open_repository({"backend": "posix_fs", "path": str(repo)}),
                              layer)
        rows["convert the layer (posix_fs)"] = {"s": round(time.perf_counter() - t0, 1),
                                                "tar_MB": round(len(tar) / 1e6, 1)}
        (work / "index.json.zst").write_bytes(index.dump())
        roots = {"unpacked layers": overlay(work, BASE, "ovu")}
        served = []
        try:
            for server in servers:
                served.append(Served(work, work / "index.json.zst", repo, server))
                roots[f"lazy ({server})"] = served[-1].rootfs
            walks: dict[str, list[dict]] = {name: [] for name in roots}
            for _ in range(args.rounds + 1):  # the first: cold chunk caches (lazy)
                for name, rootfs in roots.items():
                    walks[name].append(walk_in_sandbox(work, rootfs))
        finally:
            subprocess.run(["umount", str(roots["unpacked layers"])])
            for s in served:
                raw[s.server] = {"requests": s.close()}
        for name, runs in walks.items():
            later = runs[1:]
            rows[name] = {
                "first_walk_s": runs[0]["walk1_s"],
                "new_sandbox_walk_p50_s": round(median([r["walk1_s"] for r in later]), 3),
                "hot_walk_p50_s": round(median([r[k] for r in later
                                                for k in ("walk2_s", "walk3_s")]), 3),
                "big_file_MB_per_s_p50": round(median([r["big_file_MB_per_s"]
                                                       for r in later])),
                "files_MB": runs[0]["files_MB"], "sandboxes": len(runs)}
            raw[name] = {"walks": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    text = table("Reads in a sandbox: /usr/lib/python3.11 (1,384 files) walked 3 times per "
                 "sandbox, /usr/bin/git 10 times; the first sandbox of each root first (lazy: "
                 "chunk cache empty), then --rounds more, interleaved", rows)
    text += "\nserver requests: " + json.dumps(raw) + f"\nload average at the end: {load}\n"
    write("lazy_reads", {"rows": rows, "requests": raw, "load": load}, text)


if __name__ == "__main__":
    main()
