"""Pulled images: unpack throughput, create from a new image template, disk per sandbox.

1. Pull-and-unpack of the base rootfs as a one-layer image from a real registry
   (docker-registry on loopback) into a fresh layer store, as a plain tar, gzip and
   zstd layer; baseline: GNU ``tar -x`` (``-z``, ``--zstd``) of the same layer
   bytes from a file, in the same run, interleaved. Throughput = tar bytes / time.
2. Create from a new template (POST /images, then the first POST /sandboxes, which
   boots; template snapshots off): with cold layers (nothing cached: the base layer
   is fetched and unpacked) against cached layers (the base layer is in the store,
   only a small top layer of the new image is fetched).
3. Disk used by 20 running sandboxes of one image template (shared read-only layers;
   each sandbox writes to its own in-memory upper layer) against 20 full copies of
   its rootfs (one copy made with ``cp -a`` and measured; x20).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import zstandard

from agentenv.images import ImageService, LayerStore
from agentenv.templates import TemplateRegistry
from agentenv.testing import SHARED_HOME, Node, leaks
from agentenv.testing.oci_registry import Entry, RegistryServer, build_image, tar_layer, tar_tree
from common import summary, table, write

BASE = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
MB = 1e6


def du(path: Path) -> int:
    """Bytes allocated on disk below ``path`` (one filesystem, hard links once)."""
    out = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


def unpack_rounds(work: Path, registry: RegistryServer, base_tar: Path, rounds: int
                  ) -> tuple[dict, dict]:
    raw = base_tar.read_bytes()
    layers = {"tar": raw, "gzip": gzip.compress(raw, compresslevel=6, mtime=0),
              "zstd": zstandard.ZstdCompressor(level=3, threads=-1).compress(raw)}
    files, refs = {}, {}
    for how, data in layers.items():
        files[how] = work / f"layer.{how}"
        files[how].write_bytes(data)
        refs[how] = registry.push(f"bench/base-{how}", "v1", build_image([raw], [how]))
    flags = {"tar": [], "gzip": ["-z"], "zstd": ["--zstd"]}
    samples: dict[str, list[float]] = {}
    for i in range(rounds):
        for how in layers:
            dest = work / f"tar-{how}-{i}"
            dest.mkdir()
            t0 = time.perf_counter()
            subprocess.run(["tar", "-C", str(dest), "--numeric-owner", "--xattrs",
                            *flags[how], "-xf", str(files[how])], check=True)
            samples.setdefault(f"tar -x ({how})", []).append(time.perf_counter() - t0)
            shutil.rmtree(dest)
            store = work / f"store-{how}-{i}"
            templates = TemplateRegistry(store / "builtin", store / "local", store / "rootfs")
            svc = ImageService(LayerStore(store / "cache", 1 << 40), templates, store / "s")
            svc.start()
            t0 = time.perf_counter()
            svc.pull(refs[how], "bench")
            samples.setdefault(f"pull + unpack ({how})", []).append(time.perf_counter() - t0)
            svc.close()
            shutil.rmtree(store)
    rows = {k: summary(v) for k, v in samples.items()}
    for row in rows.values():
        row["MB_per_s"] = round(len(raw) / MB / (row["p50_ms"] / 1000), 1)
    sizes = {how: len(data) for how, data in layers.items()}
    return rows, sizes


def create_rounds(node: Node, registry: RegistryServer, base_tar: Path, rounds: int) -> dict:
    raw = base_tar.read_bytes()
    samples: dict[str, list[float]] = {}

    def new_image(tag: str) -> str:
        top = tar_layer([Entry("etc/", type=tarfile.DIRTYPE, mode=0o755),
                         Entry("etc/bench-round", tag.encode())])
        return registry.push("bench/app", tag, build_image([raw, top], ["zstd", "gzip"]))

    def create_from_new(ref: str, name: str, api) -> float:
        t0 = time.perf_counter()
        with api.stream("POST", "/images", json={"image": ref, "name": name},
                        timeout=600) as r:
            assert r.status_code == 200, r.read()
            last = [line for line in r.iter_lines() if line.strip()][-1]
            assert '"done"' in last, last
        r = api.post("/sandboxes", json={"templateID": name, "timeout": 60}, timeout=300)
        assert r.status_code == 201, r.text
        took = time.perf_counter() - t0
        assert api.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
        return took

    with node.client() as api:
        api.timeout = 600
        for i in range(rounds):  # cold: deleting the template drops its layers
            took = create_from_new(new_image(f"cold{i}"), f"cold{i}", api)
            samples.setdefault("new template, cold layers (pull all + boot)", []).append(took)
            assert api.delete(f"/images/cold{i}").status_code == 204
        create_from_new(new_image("keeper"), "keeper", api)  # keeps the base layer cached
        for i in range(rounds):
            took = create_from_new(new_image(f"warm{i}"), f"warm{i}", api)
            samples.setdefault("new template, cached layers (pull top + boot)", []
                               ).append(took)
    return {k: summary(v) for k, v in samples.items()}


def disk_rounds(node: Node, registry: RegistryServer, base_tar: Path, work: Path,
                count: int) -> dict:
    ref = registry.push("bench/disk", "v1", build_image([base_tar.read_bytes()], ["zstd"]))
    with node.client() as api:
        api.timeout = 600
        with api.stream("POST", "/images", json={"image": ref, "name": "disk"}) as r:
            assert r.status_code == 200
            r.read()
        before = du(node.home)
        ids = []
        try:
            for _ in range(count):
                r = api.post("/sandboxes", json={"templateID": "disk", "timeout": 300})
                assert r.status_code == 201, r.text
                ids.append(r.json()["sandboxID"])
            after = du(node.home)
            layers = du(node.home / "cache" / "images" / "layers")
        finally:
            for sid in ids:
                api.delete(f"/sandboxes/{sid}")
    copy = work / "full-copy"
    subprocess.run(["cp", "-a", str(BASE), str(copy)], check=True)
    one = du(copy)
    shutil.rmtree(copy)
    return {
        f"{count} sandboxes: node home growth": {"MB": round((after - before) / MB, 1)},
        f"{count} sandboxes: shared layer store": {"MB": round(layers / MB, 1)},
        f"{count} sandboxes: total": {"MB": round((after - before + layers) / MB, 1)},
        "one full rootfs copy (cp -a)": {"MB": round(one / MB, 1)},
        f"{count} full copies": {"MB": round(count * one / MB, 1)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sandboxes", type=int, default=20)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-img-"))
    base_tar = tar_tree(BASE, work / "base.tar")
    registry = RegistryServer(work / "registry").start()
    node = None
    try:
        unpack, sizes = unpack_rounds(work, registry, base_tar, args.rounds)
        node = Node(work / "home", "xbi", "10.26.0.0/16", AENV_TEMPLATE_SNAPSHOTS="false",
                    AENV_NET_POOL_LOW="4", AENV_NET_POOL_HIGH="8",
                    AENV_MAX_SANDBOXES=str(max(64, args.sandboxes)))
        node.start()
        creates = create_rounds(node, registry, base_tar, args.rounds)
        disk = disk_rounds(node, registry, base_tar, work, args.sandboxes)
    finally:
        code = node.stop() if node else 0
        registry.stop()
    left = leaks("xbi", work / "home")
    shutil.rmtree(work, ignore_errors=True)
    text = table(f"Pull + unpack vs tar -x (base rootfs: tar {sizes['tar'] / MB:.0f} MB, "
                 f"gzip {sizes['gzip'] / MB:.0f} MB, zstd {sizes['zstd'] / MB:.0f} MB)", unpack)
    text += "\n" + "\n".join(
        f"- {how}: pull + unpack {unpack[f'pull + unpack ({how})']['MB_per_s']} MB/s, "
        f"tar -x {unpack[f'tar -x ({how})']['MB_per_s']} MB/s "
        f"({unpack[f'pull + unpack ({how})']['p50_ms'] / unpack[f'tar -x ({how})']['p50_ms']:.2f}"
        "x the time of tar -x)" for how in sizes) + "\n"
    text += "\n" + table("Create from a new image template (HTTP, one node, boots)", creates)
    text += "\n" + table("Disk used by sandboxes of one image template", disk)
    text += f"\nnode exit {code}, leaks {left or 'none'}\n"
    write("images", {"unpack": unpack, "layer_bytes": sizes, "create": creates, "disk": disk,
                     "node_exit": code, "leaks": left}, text)


if __name__ == "__main__":
    main()
