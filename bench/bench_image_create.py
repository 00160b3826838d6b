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
2. The setup path (``imageSetup``): the first create (pull + boot + setup + snapshot),
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

from agentenv.testing import SHARED_HOME, Node, leaks, sdk_env
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
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-ic-"))
    base = tar_tree(BASE, work / "base.tar").read_bytes()
    registry = RegistryServer(work / "registry").start()
    node = Node(work / "home", "xic", "10.111.0.0/16", AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            first = first_command_rounds(node, registry, base, work, args.rounds)
            setup = setup_rounds(node, registry, base, args.creates, args.parallel)
    finally:
        code = node.stop()
        registry.stop()
    left = leaks("xic", work / "home")
    shutil.rmtree(work, ignore_errors=True)
    text = table(f"Time to first command from a never-seen image (base rootfs, "
                 f"{len(base) / MB:.0f} MB tar, as zstd)", first)
    text += "\n" + table("Setup once per image, then restore its snapshot", setup)
    text += f"\nnode exit {code}, leaks {left or 'none'}\n"
    write("image_create", {"first_command": first, "setup": setup, "node_exit": code,
                           "leaks": left}, text)


if __name__ == "__main__":
    main()
