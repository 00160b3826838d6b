"""Create straight from an image: time to first command from a never-seen image, and
the setup-snapshot path's creates per second.

1. Time to first command (the e2b SDK: create, then ``commands.run("true")``) from a
   never-seen image (the base rootfs as a zstd layer plus a small top layer, pushed
   to docker-registry on loopback; template snapshots off, so every create boots):
   - create from the image (``template="docker://REF"``: pull on first use, then boot);
   - pull, then create (``POST /images`` to the end of its stream, then the template);
   - baseline: ``tar --zstd -x`` of the same two layers into a directory.
   The image's template is deleted after each round (its layers go with it), so each
   round starts from nothing; the three ways are interleaved.
2. Lazy loading (``image_loading = "lazy"``, a node of its own): time to first command
   and bytes fetched before it (the node's chunk cache, raw bytes) for an image the
   repository has never seen (its layers converted, then the sandbox starts on FUSE
   mounts of them), then from a second node sharing the repository (no registry read,
   no conversion); beside it the pull-then-create path's bytes (the whole compressed
   image). Then a cold and a hot read of a directory of files inside a lazy sandbox
   and inside one of an unpacked image (hot reads come from the page cache).
3. The setup path (``imageSetup``): the first create (pull + boot + setup + snapshot),
   then creates of the same (image, command) pair restoring that snapshot, ``--parallel``
   at once over HTTP, each followed by a first command; creates per second = sandboxes /
   wall time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import zstandard
from e2b import Sandbox

from agentenv.testing import SHARED_HOME, Node, free_cidr, leaks, sdk_env
from agentenv.testing.oci_registry import Entry, RegistryServer, build_image, tar_layer, tar_tree
from common import summary, table, write

BASE = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
MB = 1e6


def first_command_rounds(node: Node, registry: RegistryServer, base: bytes, work: Path,
                         rounds: int) -> dict:
    samples: dict[str, list[float]] = {}
    zbase = zstandard.ZstdCompressor(level=3, threads=-1).compress(base)
    (work / "base.tar.zst").write_bytes(zbase)
    api = node.client()
    api.timeout = 600

    def new_image(tag: str) -> str:
        top = tar_layer([Entry("etc/", type=tarfile.DIRTYPE, mode=0o755),
                         Entry("etc/bench-round", tag.encode())])
        (work / "top.tar").write_bytes(top)
        return registry.push("bench/never-seen", tag, build_image([base, top], ["zstd", "tar"]))

    def first_command(template: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        sbx = Sandbox.create(template=template, timeout=120, request_timeout=600)
        sbx.commands.run("true")
        took = time.perf_counter() - t0
        template_id = sbx.get_info().template_id
        sbx.kill()
        return took, template_id

    def pull(ref: str, name: str) -> None:
        with api.stream("POST", "/images", json={"image": ref, "name": name}) as r:
            assert r.status_code == 200, r.read()
            last = [line for line in r.iter_lines() if line.strip()][-1]
            assert '"done"' in last, last

    for i in range(rounds):
        ref = new_image(f"direct{i}")
        took, template_id = first_command(f"docker://{ref}")
        samples.setdefault("create from the image (docker://REF)", []).append(took)
        assert api.delete(f"/images/{template_id}").status_code == 204

        ref = new_image(f"pulled{i}")
        t0 = time.perf_counter()
        pull(ref, f"pulled{i}")
        took, _ = first_command(f"pulled{i}")
        samples.setdefault("pull, then create", []).append(time.perf_counter() - t0)
        assert api.delete(f"/images/pulled{i}").status_code == 204

        dest = work / f"tar-{i}"
        dest.mkdir()
        t0 = time.perf_counter()
        subprocess.run(["tar", "-C", str(dest), "--numeric-owner", "--zstd", "-xf",
                        str(work / "base.tar.zst")], check=True)
        subprocess.run(["tar", "-C", str(dest), "-xf", str(work / "top.tar")], check=True)
        samples.setdefault("tar -x of the same layers", []).append(time.perf_counter() - t0)
        shutil.rmtree(dest)
    api.close()
    return {k: summary(v) for k, v in samples.items()}


# Inside the sandbox: every file below a directory read twice (cold, then hot: the
# per-file cost), then one big file read once, then ten times (the per-byte cost once
# cached).
READ_TWICE = (
    "python3 -c \"import os, time\n"
    "def run():\n"
    "    t, n = time.perf_counter(), 0\n"
    "    for d, _, fs in os.walk('/usr/lib/python3.11'):\n"
    "        for f in fs:\n"
    "            p = os.path.join(d, f)\n"
    "            if os.path.isfile(p) and not os.path.islink(p):\n"
    "                with open(p, 'rb') as h: n += len(h.read())\n"
    "    return time.perf_counter() - t, n\n"
    "a, n = run(); b, _ = run()\n"
    "open('/usr/bin/git', 'rb').read()\n"
    "t = time.perf_counter()\n"
    "for _ in range(10):\n"
    "    with open('/usr/bin/git', 'rb') as h: m = len(h.read())\n"
    "print(a, b, n, time.perf_counter() - t, 10 * m)\"")


def read_twice(sbx: Sandbox) -> dict:
    cold, hot, n, big_s, big = sbx.commands.run(READ_TWICE, timeout=300).stdout.split()
    return {"files_MB": round(int(n) / MB, 1), "cold_s": round(float(cold), 3),
            "hot_s": round(float(hot), 3),
            "hot_big_file_MB_per_s": round(int(big) / MB / max(float(big_s), 1e-6))}


def chunk_cache_bytes(node: Node) -> int:
    chunks = node.home / "cache" / "images" / "lazy" / "chunks"
    return sum(p.stat().st_size for p in chunks.rglob("*") if p.is_file())


def lazy_rounds(registry: RegistryServer, base: bytes, work: Path) -> tuple[dict, dict, list]:
    zbase = (work / "base.tar.zst").read_bytes()
    top = tar_layer([Entry("etc/", type=tarfile.DIRTYPE, mode=0o755),
                     Entry("etc/bench-round", b"lazy")])
    ref = registry.push("bench/lazy", "v1", build_image([base, top], ["zstd", "tar"]))
    rows: dict[str, dict] = {}
    reads: dict[str, dict] = {}
    left: list = []
    first = Node(work / "home-lazy1", "xil", free_cidr(102, 18, 1),
                 AENV_TEMPLATE_SNAPSHOTS="false", AENV_IMAGE_LOADING="lazy")
    second = Node(work / "home-lazy2", "xim", free_cidr(102, 18, 9),
                  AENV_TEMPLATE_SNAPSHOTS="false", AENV_IMAGE_LOADING="lazy",
                  AENV_SNAPSHOT_PATH=str(work / "home-lazy1" / "snapshots"))
    for name, node in (("lazy: never-seen image (convert into the repository, then start)",
                        first),
                       ("lazy: second node sharing the repository, first start", second)):
        node.start()
        try:
            with sdk_env(node.e2b_env()):
                t0 = time.perf_counter()
                sbx = Sandbox.create(template=f"docker://{ref}", timeout=300,
                                     request_timeout=600)
                sbx.commands.run("true")
                took = time.perf_counter() - t0
                fetched = chunk_cache_bytes(node)
                rows[name] = {"first_command_s": round(took, 2),
                              "fetched_MB": round(fetched / MB, 1),
                              "of_image_pct": round(100 * fetched / len(base), 1)}
                if node is first:
                    reads["lazy (FUSE layers)"] = read_twice(sbx)
                sbx.kill()
        finally:
            node.stop()
        left += leaks(node.prefix, node.home)
    rows["pull, then create: bytes read from the registry"] = {
        "fetched_MB": round((len(zbase) + len(top)) / MB, 1),
        "of_image_pct": round(100 * (len(zbase) + len(top)) / len(base), 1)}
    return rows, reads, left


def setup_rounds(node: Node, registry: RegistryServer, base: bytes, count: int,
                 parallel: int) -> dict:
    ref = registry.push("bench/setup", "v1", build_image([base], ["zstd"]))
    body = {"image": ref, "imageSetup": "echo ready > /opt/setup-done", "timeout": 120}
    rows: dict[str, dict] = {}
    with node.client() as api:
        api.timeout = 600
        t0 = time.perf_counter()
        r = api.post("/sandboxes", json=body)
        assert r.status_code == 201, r.text
        rows["first create (pull + boot + setup + snapshot)"] = summary(
            [time.perf_counter() - t0])
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")

        def one(_: int) -> float:
            t = time.perf_counter()
            with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key},
                              timeout=600) as c:
                created = c.post("/sandboxes", json=body)
                assert created.status_code == 201, created.text
                sid = created.json()["sandboxID"]
                out = Sandbox.connect(sid).commands.run("cat /opt/setup-done").stdout
                assert out.strip() == "ready", out
                took = time.perf_counter() - t
                c.delete(f"/sandboxes/{sid}")
            return took

        t0 = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            each = list(pool.map(one, range(count)))
        wall = time.perf_counter() - t0
    rows[f"later creates + first command ({parallel} at once)"] = summary(each)
    rows["setup path: creates per second"] = {"per_s": round(count / wall, 2),
                                              "sandboxes": count, "wall_s": round(wall, 2)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--creates", type=int, default=12)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--only-lazy", action="store_true",
                    help="the lazy section and one unpacked round only (a brief run)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-ic-"))
    base = tar_tree(BASE, work / "base.tar").read_bytes()
    registry = RegistryServer(work / "registry").start()
    node = Node(work / "home", "xic", "10.111.0.0/16", AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    setup: dict = {}
    try:
        with sdk_env(node.e2b_env()):
            first = first_command_rounds(node, registry, base, work, args.rounds)
            # A hot read in a sandbox of the unpacked image, beside the lazy one's.
            pulled = registry.push("bench/unpacked", "v1", build_image([base], ["zstd"]))
            sbx = Sandbox.create(template=f"docker://{pulled}", timeout=300,
                                 request_timeout=600)
            unpacked_read = read_twice(sbx)
            sbx.kill()
            if not args.only_lazy:
                setup = setup_rounds(node, registry, base, args.creates, args.parallel)
    finally:
        code = node.stop()
    left = leaks("xic", work / "home")
    try:
        lazy, reads, lazy_left = lazy_rounds(registry, base, work)
    finally:
        registry.stop()
    left += lazy_left
    reads["unpacked layers"] = unpacked_read
    shutil.rmtree(work, ignore_errors=True)
    text = table(f"Time to first command from a never-seen image (base rootfs, "
                 f"{len(base) / MB:.0f} MB tar, as zstd)", first)
    text += "\n" + table("Lazy loading: time to first command, bytes fetched before it "
                         "(raw chunk bytes; % of the image's tar)", lazy)
    text += "\n" + table("Reads inside a sandbox: /usr/lib/python3.11 (1,384 files) cold, "
                         "then hot; /usr/bin/git read 10 times (hot)", reads)
    if setup:
        text += "\n" + table("Setup once per image, then restore its snapshot", setup)
    text += f"\nnode exit {code}, leaks {left or 'none'}\n"
    # A brief run does not replace the full run's results.
    write("image_create_lazy" if args.only_lazy else "image_create",
          {"first_command": first, "lazy": lazy, "reads": reads, "setup": setup,
           "node_exit": code, "leaks": left}, text)


if __name__ == "__main__":
    main()
