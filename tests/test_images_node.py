"""Image templates on a real node: pulled over HTTP (NDJSON progress) and with `aenv pull`,
started with the e2b SDK, under a cache budget smaller than the images in use."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node, free_cidr, leaks, sdk_env
from agentenv.testing.nodes import AENV
from agentenv.testing.oci_registry import (
    BUSYBOX,
    DEFAULT_PATH,
    Entry,
    RegistryServer,
    build_image,
    busybox_layer,
    tar_layer,
    write_oci_layout,
)

PREFIX = f"i{os.getpid() % 4096:03x}"
CIDR = free_cidr(160, 10, os.getpid())
TOP_MIB = 8
ENTRY_OVERHEAD = 512  # what the store counts per tar entry


pytestmark = pytest.mark.skipif(not BUSYBOX.exists(), reason="needs busybox-static")


def accounted(layer: bytes) -> int:
    """The bytes the layer store counts for a layer (data of regular files + per entry)."""
    total = 0
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        for member in tar:
            total += ENTRY_OVERHEAD + (member.size if member.isreg() else 0)
    return total


def top_layer(name: str) -> bytes:
    return tar_layer([
        Entry("etc/", type=tarfile.DIRTYPE, mode=0o755), Entry("etc/.wh.motd"),
        Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
        Entry(f"opt/{name}", os.urandom(TOP_MIB << 20)),
        Entry("opt/hello", f"hello from {name}\n".encode(), mode=0o755),
    ])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("images-node")
    # A busybox root (~1 MiB) shared by the three images: what is tested is the
    # layers' store, budget and mounts, which a whole distribution's layer only slows.
    base = busybox_layer()
    top_size = TOP_MIB * (1 << 20) + 6 * ENTRY_OVERHEAD
    # Room for the base layer and two and a half top layers: three images do not fit.
    budget = accounted(base) + int(top_size * 2.5)
    registry = RegistryServer(tmp / "registry").start()
    try:
        refs = {name: registry.push(f"apps/{name}", "v1", build_image(
            [base, top_layer(name)], ["tar", how],
            # The image's ENV, WORKDIR and USER are what its sandboxes' commands get.
            env=[f"PATH={DEFAULT_PATH}", f"GREETING=hi from {name}"], workdir="/opt",
            user="user" if name == "img-c" else ""))
                for name, how in (("img-a", "gzip"), ("img-b", "zstd"), ("img-c", "tar"))}
        node = Node(tmp / "home", PREFIX, CIDR, AENV_IMAGE_CACHE_BYTES=str(budget),
                    AENV_IMAGE_IMPORT_DIR=str(tmp))
        node.start()
        with sdk_env(node.e2b_env()):
            yield {"node": node, "registry": registry, "refs": refs, "budget": budget, "tmp": tmp}
        node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def pull(node: Node, ref: str, name: str) -> list[dict]:
    with node.client() as api, api.stream("POST", "/images", json={"image": ref, "name": name},
                                          timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def images(node: Node) -> dict:
    with node.client() as api:
        return api.get("/images").json()


def test_pull_over_http(world: dict) -> None:
    node = world["node"]
    for name in ("img-a", "img-b", "img-c"):
        events = pull(node, world["refs"][name], name)
        assert events[0]["status"] == "resolving"
        assert events[-1]["status"] == "done"
        assert events[-1]["template"]["templateID"] == name
        statuses = {e["status"] for e in events}
        assert "done-layer" in statuses
    listing = images(node)
    cached = {i["name"]: i["cachedLayers"] for i in listing["images"]}
    # The third pull went over budget: the least recently used top layer (img-a's) left.
    assert cached == {"img-a": 1, "img-b": 2, "img-c": 2}
    assert listing["cache"]["bytes"] <= world["budget"]
    with node.client() as api:
        ids = {t["templateID"] for t in api.get("/templates").json()}
    assert {"img-a", "img-b", "img-c"} <= ids


def test_templates_start_within_budget(world: dict) -> None:
    node = world["node"]
    sandboxes = {}
    try:
        for name in ("img-a", "img-c", "img-b"):  # img-a's layer is fetched again
            sbx = Sandbox.create(template=name, timeout=120)
            sandboxes[name] = sbx
            out = sbx.commands.run(f"cat /opt/hello; wc -c < /opt/{name}; "
                                   "test -e /etc/motd || echo no-motd; "
                                   "echo private > /tmp/w && cat /tmp/w")
            assert out.stdout.split() == ["hello", "from", name, str(TOP_MIB << 20),
                                          "no-motd", "private"]
            out = sbx.commands.run("echo $GREETING; pwd; whoami")
            assert out.stdout.split("\n")[:3] == [
                f"hi from {name}", "/opt", "user" if name == "img-c" else "root"], out.stdout
        # All three run though they do not fit the budget together: in-use layers stay.
        listing = images(node)
        assert all(i["cachedLayers"] == 2 for i in listing["images"]), listing
        assert listing["cache"]["bytes"] > world["budget"]
        assert re.search(r"evicted layer", node.log_path.read_text())
        # A sandbox's writes are its own: the next sandbox of the template sees none.
        sandboxes["img-a"].commands.run("echo mine > /tmp/only-here")
        other = Sandbox.create(template="img-a", timeout=120)
        sandboxes["img-a2"] = other
        assert other.commands.run("test -e /tmp/only-here || echo absent").stdout.strip() == \
            "absent"
        with node.client() as api:
            r = api.delete("/images/img-a")
            assert r.status_code == 409 and "in use" in r.json()["message"], r.text
        # Pause holds no layers; resume ensures them again.
        sandboxes["img-b"].beta_pause()
        with node.client() as api:  # a paused sandbox resumes from its template
            assert api.delete("/images/img-b").status_code == 409
        resumed = Sandbox.connect(sandboxes["img-b"].sandbox_id, timeout=120)
        assert resumed.commands.run("cat /opt/hello").stdout.strip() == "hello from img-b"
    finally:
        for sbx in sandboxes.values():
            sbx.kill()
    with node.client() as api:
        assert api.delete("/images/img-a").status_code == 204
        assert api.delete("/images/img-a").status_code == 404
        r = api.post("/sandboxes", json={"templateID": "img-a"})
        assert r.status_code == 404
    assert "img-a" not in {i["name"] for i in images(node)["images"]}


def pull_error(r: httpx.Response) -> dict:
    """The error a pull ended with, in either of the answer's forms: a plain JSON error
    with its status when found within the node's hold (routes/images.py HOLD_S, 2 s),
    else the NDJSON progress stream's last line (what a loaded node sends a small
    hostile image that took longer to read)."""
    if r.headers.get("content-type", "").startswith("application/x-ndjson"):
        assert r.status_code == 200, r.text
        last = json.loads(r.text.strip().splitlines()[-1])
        assert last["status"] == "error", r.text
        return last
    assert r.status_code == r.json()["code"], r.text
    return r.json()


def test_hostile_and_bad_requests_over_http(world: dict) -> None:
    node, tmp = world["node"], world["tmp"]
    layout = write_oci_layout(tmp / "evil", build_image([tar_layer([
        Entry("../../../../../../tmp/aenv-node-escape", b"x")])]))
    cases = [
        ({"image": f"oci-layout:{layout}", "name": "evil"}, 422, "contains '..'"),
        ({"image": "Not A Ref!!", "name": "bad"}, 400, "bad repository name"),
        ({"image": f"{world['registry'].host}/apps/none:v1", "name": "none"}, 404, "not found"),
        ({"image": "127.0.0.1:9/apps/x:v1", "name": "down"}, 502, "unreachable"),
        ({"image": world["refs"]["img-b"], "name": "Bad Name"}, 400, "name must be"),
        # Local sources only below the node's image_import_dir: no host file is opened.
        ({"image": "docker-archive:/etc/shadow", "name": "shadow"}, 400,
         "local image sources must be under"),
        ({"image": f"oci-layout:{tmp}/../../../etc", "name": "etc"}, 400,
         "local image sources must be under"),
    ]
    with node.client() as api:
        for body, status, message in cases:
            r = api.post("/images", json=body)
            got = pull_error(r)
            assert got["code"] == status and message in got["message"], (body, r.text)
        assert api.get("/health").status_code == 200
    assert not Path("/tmp/aenv-node-escape").exists()
    assert list((node.home / "cache/images/tmp").iterdir()) == []
    assert not (node.home / "templates/evil").exists()


def test_cli_pull(world: dict) -> None:
    node, tmp = world["node"], world["tmp"]
    image = build_image([tar_layer([Entry("hello.txt", b"small")])], ["zstd"])
    layout = write_oci_layout(tmp / "small", image, tag="v1")
    env = {**os.environ, "AENV_API_URL": node.url, "AENV_API_KEY": node.api_key,
           "COLUMNS": "200"}
    out = subprocess.run([str(AENV), "pull", f"oci-layout:{layout}:v1", "--name", "small"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("small  sha256:")
    layer = image.layers[0]
    # One progress bar per layer, named by its digest, run to the layer's size.
    assert re.search(rf"{layer.digest[7:19]}.*{len(layer.data)}/{len(layer.data)} bytes",
                     out.stderr), out.stderr
    bad = subprocess.run([str(AENV), "pull", "127.0.0.1:9/x/y:z", "--name", "nope"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unreachable" in bad.stderr and "Traceback" not in bad.stderr
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}) as api:
        assert "small" in {i["name"] for i in api.get("/images").json()["images"]}


def test_kill9_restart_keeps_used_mounts_and_cleans_the_rest(world: dict) -> None:
    node = world["node"]
    with node.client() as api:
        used = api.post("/sandboxes", json={"templateID": "img-c", "timeout": 120}).json()
        idle = api.post("/sandboxes", json={"templateID": "img-b", "timeout": 120}).json()
        assert api.delete(f"/sandboxes/{idle['sandboxID']}").status_code == 204
    mounts = node.home / "run" / "rootfs"
    by_name = {i["name"]: i for i in images(node)["images"]}
    used_mount = mounts / by_name["img-c"]["manifestDigest"].split(":")[1][:16]
    idle_mount = mounts / by_name["img-b"]["manifestDigest"].split(":")[1][:16]
    assert os.path.ismount(used_mount) and os.path.ismount(idle_mount)
    half = node.home / "cache/images/tmp/deadbeef.crashed"
    half.mkdir()
    (half / "partial").write_bytes(b"x" * 4096)
    node.kill9()
    node.start()
    # The sandbox that survived is adopted and still has its rootfs; the rest is gone.
    assert os.path.ismount(used_mount)
    assert not os.path.ismount(idle_mount)
    assert not half.exists()
    sbx = Sandbox.connect(used["sandboxID"])
    assert sbx.commands.run("cat /opt/hello").stdout.strip() == "hello from img-c"
    sbx.kill()
