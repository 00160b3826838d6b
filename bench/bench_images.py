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
import datetime
import functools
import gzip
import hashlib
import io
import os
import re
import resource
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import zstandard
from e2b import Sandbox

from agentenv.images import ImageService, LayerStore
from agentenv.images.estargz_build import build_estargz
from agentenv.images.manifest import TOC_DIGEST_ANNOTATION
from agentenv.templates import TemplateRegistry
from agentenv.testing import SHARED_HOME, Node, free_cidr, leaks, sdk_env
from agentenv.testing.oci_registry import (
    LAYER_TYPES,
    Entry,
    RegistryServer,
    build_image,
    manifest_for,
    tar_layer,
    tar_tree,
)
from common import main_with_modes, summary, table, write

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
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=('mode `estargz`: the first command from a never-seen 1 GB image: eStargz '
                'and plain gzip loaded lazily, against a pull (bench_images.py estargz '
                '--help)'))
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


# -------------------- mode `estargz` (formerly bench_image_estargz.py)
# A never-seen 1 GB image with a 20 MB working set: eStargz read lazily from the
# registry, a plain gzip image read lazily through its checkpoint index (built by the
# first node, shared through the repository), against convert-then-lazy and
# pull-then-create, beside ``tar -x``.
#
# The image: the ``base`` rootfs (one layer) and a data layer of ~1 GB of incompressible
# files, of which the first command's task reads 20 files of 1 MiB
# (``cat /data/work/* | md5sum``). It is pushed to docker-registry on loopback twice:
# as plain gzip layers and as eStargz layers (``images.estargz_build``, 4 MiB chunks);
# the registry's access log counts the blob bytes it sends.
#
# Each round, each way starts a node with an empty home (no layers, no repository, no
# chunk cache: the image is never-seen) and times the e2b SDK's create and the first
# command, then counts the registry's blob bytes sent until the command returned:
# - eStargz, lazy (``image_loading = "lazy"``): footer and TOC by range, chunks on read;
# - ``gzindex``: plain gzip, lazy, the first node: each layer read once to index it
#   (checkpoints, file table; stored in a repository shared with the next way), then
#   spans by range;
# - ``gzshared``: plain gzip, lazy, a second node (empty home, the same repository):
#   the index from the repository, spans by range, nothing read whole; the files the
#   first node's run read (recorded there) fetched ahead from the layers' mounts;
# - ``gzshared0``: the same without prefetching (``image_prefetch = false``);
# - ``convert``: plain gzip, lazy, the layers converted into the repository first
#   (``image_gzip_index = false``);
# - plain gzip, pull then create (``POST /images``, unpack, then the template);
# - floor: ``tar -xzf`` of the same plain gzip layers into a directory.
# Template snapshots are off (every create boots). The registry's blob files are in the
# page cache after the first round, for every way alike.


MIB = 1 << 20
TASK = "cat /data/work/* | md5sum"


def data_tar(path: Path, bulk_mib: int, work_files: int) -> Path:
    """/data/work: ``work_files`` files of 1 MiB (the task's working set), /data/bulk:
    the rest of the GB in 16 MiB files, all random bytes."""
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("data", "data/work", "data/bulk"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tar.addfile(info)
        files = [(f"data/work/w{i:02d}", MIB) for i in range(work_files)]
        files += [(f"data/bulk/b{i:03d}", 16 * MIB) for i in range(bulk_mib // 16)]
        for name, size in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = size, 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(os.urandom(size)))
    os.replace(tmp, path)
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(4 * MIB):
            h.update(piece)
    return "sha256:" + h.hexdigest()


def layers(work: Path, tars: list[Path]) -> dict[str, list[dict]]:
    """Each tar as plain gzip and as eStargz: descriptors with their files, diff IDs."""
    out: dict[str, list[dict]] = {"gzip": [], "estargz": []}
    for t in tars:
        gz = t.with_suffix(".tar.gz")
        if not gz.exists():
            with open(gz.with_suffix(".tmp"), "wb") as f:
                subprocess.run(["gzip", "-1", "-c", str(t)], stdout=f, check=True)
            os.replace(gz.with_suffix(".tmp"), gz)
        out["gzip"].append({"path": gz, "digest": sha256_file(gz), "size": gz.stat().st_size,
                            "diff_id": sha256_file(t), "annotations": {}})
        esgz = t.with_suffix(".esgz")
        meta = t.with_suffix(".esgz.meta")
        if not meta.exists():
            t0 = time.perf_counter()
            with open(t, "rb") as src, open(esgz, "wb") as dst:
                built = build_estargz(src, dst, level=1)
            meta.write_text(f"{built.digest} {built.size} {built.diff_id} {built.toc_digest} "
                            f"{time.perf_counter() - t0:.1f}")
        digest, size, diff_id, toc, took = meta.read_text().split()
        out["estargz"].append({"path": esgz, "digest": digest, "size": int(size),
                               "diff_id": diff_id, "convert_s": float(took),
                               "annotations": {TOC_DIGEST_ANNOTATION: toc}})
    return out


def push(registry: RegistryServer, repo: str, ls: list[dict]) -> str:
    for x in ls:
        registry.push_file(repo, x["path"], x["digest"])
    descriptors = [{"mediaType": LAYER_TYPES["gzip"], "digest": x["digest"], "size": x["size"],
                    **({"annotations": x["annotations"]} if x["annotations"] else {})}
                   for x in ls]
    config, manifest = manifest_for(descriptors, [x["diff_id"] for x in ls])
    registry.push_blob(repo, config)
    registry.push_manifest(repo, "v1", manifest)
    return f"{registry.host}/{repo}:v1"


def one_round(way: str, ref: str, repo: str, registry: RegistryServer, work: Path,
              cidr: str, expect: str) -> tuple[dict, list]:
    home = work / f"home-{way}"
    shutil.rmtree(home, ignore_errors=True)
    env = {"AENV_TEMPLATE_SNAPSHOTS": "false", "AENV_LOCAL_CACHE_BYTES": str(16 << 30)}
    env["AENV_IMAGE_LOADING"] = "unpack" if way == "pull" else "lazy"
    if way == "convert":
        env["AENV_IMAGE_GZIP_INDEX"] = "false"
    if way == "gzshared0":
        env["AENV_IMAGE_PREFETCH"] = "false"
    if way in ("gzindex", "gzshared", "gzshared0"):  # one repository, outside the homes
        shared = work / "shared-repo"
        if way == "gzindex":
            shutil.rmtree(shared, ignore_errors=True)
        env["AENV_SNAPSHOT_PATH"] = str(shared)
    node = Node(home, "xes", cidr, **env)
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            before = registry.blob_bytes_sent(repo)
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            if way == "pull":
                with node.client() as api:
                    api.timeout = 1800
                    with api.stream("POST", "/images", json={"image": ref, "name": "big"}) as r:
                        assert r.status_code == 200, r.read()
                        last = [line for line in r.iter_lines() if line.strip()][-1]
                        assert '"done"' in last, last
                template = "big"
            else:
                template = f"docker://{ref}"
            sbx = Sandbox.create(template=template, timeout=600, request_timeout=1800)
            out = sbx.commands.run(TASK, timeout=600).stdout.split()[0]
            took = time.perf_counter() - t0
            time.sleep(0.5)  # the registry logs a response once it is done
            fetched = registry.blob_bytes_sent(repo) - before
            assert out == expect, (out, expect)
            sbx.kill()
            # The same again on this node (layers mounted, chunks cached): the floor a
            # second node's first command is held to.
            t1 = time.perf_counter()
            sbx = Sandbox.create(template=template, timeout=600, request_timeout=1800)
            assert sbx.commands.run(TASK, timeout=600).stdout.split()[0] == expect
            again = time.perf_counter() - t1
            sbx.kill()
    finally:
        node.stop()
    left = leaks("xes", home)
    phases = node_phases(node.log_path.read_text())
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    shutil.copy(node.log_path, logs / f"{way}-{time.strftime('%H%M%S')}.log")
    for f in (home / "cache" / "images" / "lazy" / "logs").glob("*.log"):
        shutil.copy(f, logs / f"{way}-{time.strftime('%H%M%S')}-layer-{f.name}")
    shutil.rmtree(home, ignore_errors=True)
    row = {"s": took, "fetched": fetched, "load": load, "again_s": round(again, 2), **phases}
    if way == "gzindex":
        row["index_bytes"] = sum(p.stat().st_size
                                 for p in (work / "shared-repo" / "image-layers").glob("*"))
    return row, left


def index_build(built: list[dict]) -> dict:
    """In-process, the layers from local files: building the checkpoint index against
    ``gzip -dc`` of the same layer (decompression alone, the least any pull does)."""
    from agentenv.images.gzip_layer import index_gzip_layer
    from agentenv.snapshot.layer_index import RegistryBlob
    out: dict = {"index_s": 0.0, "index_cpu_s": 0.0, "gunzip_s": 0.0, "points": 0}
    for x in built:
        t, c = time.perf_counter(), time.process_time()
        with open(x["path"], "rb") as f:
            index = index_gzip_layer(iter(functools.partial(f.read, MIB), b""), RegistryBlob(
                "r", "r", x["digest"], x["size"], x["size"]), diff_id=x["diff_id"])
        out["index_s"] += time.perf_counter() - t
        out["index_cpu_s"] += time.process_time() - c
        out["points"] += len(index.gzip.points) if index.gzip else 0
        t, c = time.perf_counter(), _children_cpu()
        subprocess.run(f"gzip -dc {x['path']} > /dev/null", shell=True, check=True)
        out["gunzip_s"] += time.perf_counter() - t
        out["gunzip_cpu_s"] = out.get("gunzip_cpu_s", 0.0) + _children_cpu() - c
        # A plain pull's least work: decompress and write the files (tar -xzf).
        dest = Path(tempfile.mkdtemp(prefix="aenv-bench-untar-"))
        try:
            t, c = time.perf_counter(), _children_cpu()
            subprocess.run(["tar", "-C", str(dest), "--numeric-owner", "-xzf",
                            str(x["path"])], check=True)
            out["untar_s"] = out.get("untar_s", 0.0) + time.perf_counter() - t
            out["untar_cpu_s"] = out.get("untar_cpu_s", 0.0) + _children_cpu() - c
        finally:
            shutil.rmtree(dest, ignore_errors=True)
    return {k: round(v, 2) for k, v in out.items()}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*"
MARKS = {"index": "pulled as template", "mount": "mounted rootfs of", "boot": "created "}


def node_phases(log: str) -> dict[str, float]:
    """Seconds from the node's first image line to the layers' indexes (resolve, TOC or
    conversion or unpack), to the rootfs mounted, to the sandbox booted (its log)."""
    def at(text: str) -> float | None:
        m = re.search(STAMP.replace(".*", ".*" + re.escape(text)), log, re.M)
        if m is None:
            return None
        return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()

    start = at("images: pulling") or at("POST /images") or at("images: ")
    out: dict[str, float] = {}
    last = start
    for name, text in MARKS.items():
        t = at(text)
        if t is not None and last is not None:
            out[f"{name}_s"] = round(t - last, 2)
            last = t
    return out


def estargz_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="bench_images.py estargz",
        description="The first command from a never-seen 1 GB image: eStargz and plain gzip "
                    "loaded lazily, against a pull.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bulk-mib", type=int, default=1024, help="incompressible bulk, MiB")
    ap.add_argument("--work-files", type=int, default=20, help="1 MiB files the task reads")
    ap.add_argument("--work", help="a directory to keep the built layers in between runs")
    ap.add_argument("--ways",
                    default="estargz,gzindex,gzshared,gzshared0,convert,pull,build,tar",
                    help="gzshared and gzshared0 run after gzindex, on its repository")
    ap.add_argument("--name", default="image_estargz", help="results file name")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="aenv-bench-esgz-"))
    work.mkdir(parents=True, exist_ok=True)
    ways = args.ways.split(",")
    t0 = time.perf_counter()
    base_tar = tar_tree(BASE, work / "base.tar")
    big_tar = data_tar(work / f"data-{args.bulk_mib}.tar", args.bulk_mib, args.work_files)
    built = layers(work, [base_tar, big_tar])
    prepared_s = time.perf_counter() - t0
    expect = hashlib.md5()
    with tarfile.open(big_tar) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.name.startswith("data/work/"):
                f = tar.extractfile(m)
                assert f is not None
                expect.update(f.read())
    tar_bytes = base_tar.stat().st_size + big_tar.stat().st_size
    registry = RegistryServer(work / "registry", access_log=True).start()
    samples: dict[str, list[dict]] = {w: [] for w in ways}
    left: list = []
    cidr = free_cidr(120, 10, os.getpid())
    try:
        refs = {"estargz": push(registry, "bench/esgz", built["estargz"]),
                "gzip": push(registry, "bench/plain", built["gzip"])}
        for i in range(args.rounds):
            for way in ways:
                if way == "tar":
                    dest = work / "tar-x"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    load = os.getloadavg()[0]
                    t = time.perf_counter()
                    for x in built["gzip"]:
                        subprocess.run(["tar", "-C", str(dest), "--numeric-owner", "-xzf",
                                        str(x["path"])], check=True)
                    samples[way].append({"s": time.perf_counter() - t, "fetched": 0,
                                         "load": load})
                    shutil.rmtree(dest)
                    continue
                if way == "build":
                    row = index_build(built["gzip"])
                    samples[way].append({"s": row["index_s"], "fetched": 0,
                                         "load": os.getloadavg()[0], **row})
                    print(f"round {i} {way}: {row}", flush=True)
                    continue
                kind = "estargz" if way == "estargz" else "gzip"
                repo = "bench/esgz" if kind == "estargz" else "bench/plain"
                row, lost = one_round(way, refs[kind], repo, registry, work, cidr,
                                      expect.hexdigest())
                samples[way].append(row)
                left += lost
                print(f"round {i} {way}: {row}", flush=True)
    finally:
        registry.stop()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    blob_bytes = {k: sum(x["size"] for x in v) for k, v in built.items()}
    names = {"estargz": "eStargz, lazy from the registry (no conversion)",
             "gzindex": "plain gzip, lazy: index once (first node), then start",
             "gzshared": "plain gzip, lazy: a second node, the index from the repository, "
                         "prefetch of the first run's files",
             "gzshared0": "plain gzip, lazy: a second node, the index from the repository, "
                          "no prefetch",
             "convert": "plain gzip, lazy: convert into the repository, then start",
             "build": "index build alone, in-process from local files (no node)",
             "pull": "plain gzip: pull (unpack), then create",
             "tar": "floor: tar -xzf of the same plain gzip layers (no sandbox)"}
    rows: dict[str, dict] = {}
    for way, xs in samples.items():
        if not xs:
            continue
        s = summary([x["s"] for x in xs])
        fetched = sorted(x["fetched"] for x in xs)[len(xs) // 2]
        blob = blob_bytes["estargz" if way == "estargz" else "gzip"]
        rows[names[way]] = {
            "n": s["n"], "p50_s": round(s["p50_ms"] / 1000, 2),
            "max_s": round(s["max_ms"] / 1000, 2),
            **({"fetched_MB": round(fetched / MB, 1),
                "of_blobs_pct": round(100 * fetched / blob, 1)}
               if way not in ("tar", "build") else {}),
            **{k: sorted(x[k] for x in xs)[len(xs) // 2]
               for k in ("again_s", "index_s", "mount_s", "boot_s", "index_bytes", "index_cpu_s",
                         "gunzip_s", "gunzip_cpu_s", "untar_s", "untar_cpu_s", "points")
               if way != "tar" and all(k in x for x in xs)},
            "load_1min": "-".join(f"{x['load']:.1f}" for x in xs)}
    text = table(
        f"First command (`{TASK}`, {args.work_files} MiB) from a never-seen image: base rootfs "
        f"+ {args.bulk_mib} MiB incompressible ({tar_bytes / MB:.0f} MB of tar; blobs "
        f"{blob_bytes['gzip'] / MB:.0f} MB gzip, {blob_bytes['estargz'] / MB:.0f} MB eStargz);"
        " registry on loopback; fetched = registry blob bytes sent until the command "
        "returned", rows)
    convert_s = [x.get("convert_s", 0) for x in built["estargz"]]
    text += (f"\nBuilding the eStargz layers (Python, gzip level 1, 4 MiB chunks): "
             f"{' + '.join(f'{c:.1f}' for c in convert_s)} s (once, before pushing; "
             f"preparation of this run {prepared_s:.0f} s). Leaks: {left or 'none'}\n")
    write(args.name, {"rows": rows, "samples": samples, "blob_bytes": blob_bytes,
                            "tar_bytes": tar_bytes, "estargz_build_s": convert_s,
                            "leaks": left}, text)


if __name__ == "__main__":
    main_with_modes(main, {"estargz": estargz_main})
