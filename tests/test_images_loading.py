"""Lazy loading by default above a size (image_loading = "auto", image_lazy_above_mb),
and the per-request choice, on a real node with real runsc and docker-registry on
loopback (its access log counts the blob bytes it sends): an image above the threshold
is loaded lazily (nothing of it unpacked, its first command reading a small part of its
blobs), one below is pulled whole and unpacked; a pull's "loading" and a create's
"imageLoading" override the size; the choice is kept in the template."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.config import ConfigError, load_config
from agentenv.images import ImageService, LayerStore, LazyLayers
from agentenv.images.mounts import mounted_under
from agentenv.images.store import hex_of
from agentenv.snapshot import open_repository
from agentenv.templates import TemplateRegistry
from agentenv.testing import Node, free_cidr, leaks, sdk_env
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

PREFIX = f"l{os.getpid() % 4096:03x}"
CIDR = free_cidr(160, 20, os.getpid() + 11)
THRESHOLD_MB = 6
BIG_MIB = 10

pytestmark = pytest.mark.skipif(not BUSYBOX.exists(), reason="needs busybox-static")


def data_layer(payload: bytes) -> bytes:
    return tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                      Entry("opt/hello", b"hello\n"), Entry("opt/data", payload)])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("images-loading")
    registry = RegistryServer(tmp / "registry", access_log=True).start()
    try:
        big, small = os.urandom(BIG_MIB << 20), os.urandom(64 << 10)
        images = {}
        for name, payload in (("big", big), ("small", small), ("big2", os.urandom(BIG_MIB << 20))):
            # eStargz (a valid gzip tar): served lazily, only what is read leaves the registry.
            image = build_image([busybox_layer(), data_layer(payload)], ["estargz", "estargz"],
                                env=[f"PATH={DEFAULT_PATH}"])
            images[name] = {"ref": registry.push(f"load/{name}", "v1", image),
                            "repo": f"load/{name}",
                            "bytes": sum(len(b.data) for b in image.layers),
                            "top_bytes": len(image.layers[1].data),
                            "layers": [b.digest for b in image.layers],
                            "md5": hashlib.md5(payload).hexdigest(),
                            "manifest": image.manifest.digest}
        assert images["big"]["bytes"] > THRESHOLD_MB << 20 > images["small"]["bytes"]
        # image_loading is left to its default ("auto").
        node = Node(tmp / "home", PREFIX, CIDR, AENV_IMAGE_LAZY_ABOVE_MB=str(THRESHOLD_MB),
                    AENV_TEMPLATE_SNAPSHOTS="false")
        node.start()
        try:
            with sdk_env(node.e2b_env()):
                yield {"node": node, "registry": registry, "images": images}
        finally:
            node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def pull(node: Node, ref: str, name: str, loading: str | None = None) -> dict:
    body = {"image": ref, "name": name, **({"loading": loading} if loading else {})}
    with node.client() as api, api.stream("POST", "/images", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert lines[-1]["status"] == "done", lines[-1]
    return lines[-1]["template"]


def listed(node: Node, name: str) -> dict:
    with node.client() as api:
        images = api.get("/images").json()["images"]
    return next(i for i in images if i["name"] == name)


# Every image's bottom layer is the same busybox layer (one digest): which way it was
# loaded depends on the image that met it first, so the checks look at the top layers.


def unpacked(node: Node, layers: list[str]) -> list[bool]:
    store = node.home / "cache" / "images" / "layers"
    return [(store / hex_of(d)).is_dir() for d in layers]


def served_lazily(node: Node, layers: list[str]) -> list[bool]:
    mnt = node.home / "cache" / "images" / "lazy" / "mnt"
    points = {p.name for p in mounted_under(mnt)}
    return [hex_of(d) in points for d in layers]


def first_command(world: dict, template: str, image: dict) -> tuple[str, int]:
    """The first command's output and the registry blob bytes sent for the image so far."""
    sbx = Sandbox.create(template=template, timeout=120)
    try:
        out = sbx.commands.run("cat /opt/hello").stdout.strip()
        sent = world["registry"].blob_bytes_sent(image["repo"])
        assert sbx.commands.run("md5sum /opt/data").stdout.split()[0] == image["md5"]
    finally:
        sbx.kill()
    return out, sent


def test_above_the_threshold_lazily_below_pulled(world: dict) -> None:
    node, images = world["node"], world["images"]
    big, small = images["big"], images["small"]
    record = pull(node, big["ref"], "big")
    assert record["image"]["loading"] == "lazy"
    out, sent = first_command(world, "big", big)
    assert out == "hello"
    # Nothing unpacked; the layers are FUSE mounts; the TOCs, busybox and hello read,
    # not the 10 MiB of /opt/data.
    assert unpacked(node, big["layers"]) == [False, False]
    assert served_lazily(node, big["layers"]) == [True, True]
    assert sent < 0.5 * big["bytes"], (sent, big["bytes"])
    assert listed(node, "big")["loading"] == "lazy"

    record = pull(node, small["ref"], "small")
    assert record["image"]["loading"] == "unpack"
    assert unpacked(node, small["layers"]) == [True, True]
    out, sent = first_command(world, "small", small)
    assert out == "hello" and sent >= small["top_bytes"]  # its blob, whole
    assert served_lazily(node, small["layers"][1:]) == [False]
    assert listed(node, "small")["loading"] == "unpack"


def test_a_pull_overrides_the_size(world: dict) -> None:
    node, images = world["node"], world["images"]
    big, small = images["big2"], images["small"]
    before = world["registry"].blob_bytes_sent(big["repo"])
    record = pull(node, big["ref"], "big-unpacked", loading="unpack")
    assert record["image"]["loading"] == "unpack"
    assert unpacked(node, big["layers"]) == [True, True]
    assert world["registry"].blob_bytes_sent(big["repo"]) - before >= big["top_bytes"]
    assert first_command(world, "big-unpacked", big)[0] == "hello"
    assert served_lazily(node, big["layers"][1:]) == [False]

    record = pull(node, small["ref"], "small-lazy", loading="lazy")
    assert record["image"]["loading"] == "lazy"
    assert first_command(world, "small-lazy", small)[0] == "hello"
    assert served_lazily(node, small["layers"]) == [True, True]
    with node.client() as api:
        r = api.post("/images", json={"image": small["ref"], "name": "x", "loading": "fast"})
        assert r.status_code in (400, 422), r.text


def test_a_create_from_an_image_chooses_too(world: dict) -> None:
    node, images = world["node"], world["images"]
    big = images["big"]
    # The same image under another reference (a new template): unpacked on request.
    ref = big["ref"].replace(":v1", "@" + big["manifest"])
    with node.client() as api:
        r = api.post("/sandboxes", json={"image": ref, "imageLoading": "unpack",
                                         "timeout": 60}, timeout=300)
        assert r.status_code == 201, r.text
        sbx = r.json()
        api.delete(f"/sandboxes/{sbx['sandboxID']}")
        template = sbx["templateID"]
        assert listed(node, template)["loading"] == "unpack"
        assert unpacked(node, big["layers"]) == [True, True]
        r = api.post("/sandboxes", json={"templateID": "base", "imageLoading": "lazy"})
        assert r.status_code == 400 and "imageLoading" in r.text, r.text
    # Without a choice, a create from the big image by its tag loads it lazily (as the
    # pull of the first test did: the template of this reference is a new one).
    sbx = Sandbox.create(template=f"docker://{big['ref']}", timeout=120)
    try:
        assert sbx.commands.run("cat /opt/hello").stdout.strip() == "hello"
    finally:
        sbx.kill()
    created = [i for i in listed_all(node) if i["image"] == big["ref"] and
               i["name"].startswith("img-")]
    assert [i["loading"] for i in created] == ["lazy"]


def listed_all(node: Node) -> list[dict]:
    with node.client() as api:
        return api.get("/images").json()["images"]


def test_config_rejects_an_unknown_loading(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    monkeypatch.setenv("AENV_IMAGE_LOADING", "sometimes")
    with pytest.raises(ConfigError, match="image_loading"):
        load_config()
    monkeypatch.setenv("AENV_IMAGE_LOADING", "auto")
    monkeypatch.setenv("AENV_IMAGE_LAZY_ABOVE_MB", "-1")
    with pytest.raises(ConfigError, match="image_lazy_above_mb"):
        load_config()


def test_auto_leaves_local_archives_unpacked(world: dict, tmp_path: Path) -> None:
    """Lazily, a local archive's layers would be converted into the repository (dearer
    than an unpack): "auto" lazily loads registry images only; "lazy" still converts."""
    repo = {"backend": "posix_fs", "path": str(tmp_path / "repo")}
    templates = TemplateRegistry(tmp_path / "builtin", tmp_path / "local", tmp_path / "rootfs")
    lazy = LazyLayers(tmp_path / "cache" / "lazy", open_repository(repo), repo)
    svc = ImageService(LayerStore(tmp_path / "cache", 1 << 30), templates,
                       tmp_path / "secrets", lazy=lazy, loading="auto", lazy_above=0)
    svc.start()
    try:
        image = build_image([busybox_layer(), data_layer(b"x" * 1000)], ["gzip", "gzip"])
        layout = write_oci_layout(tmp_path / "layout", image, tag="v1")
        assert svc.pull(f"oci-layout:{layout}:v1", "local")["image"]["loading"] == "unpack"
        assert svc.pull(world["images"]["small"]["ref"], "remote")["image"]["loading"] == "lazy"
        record = svc.pull(f"oci-layout:{layout}:v1", "local-lazy", loading="lazy")
        assert record["image"]["loading"] == "lazy"
        assert (tmp_path / "repo" / "image-layers").is_dir()
        assert len(list((tmp_path / "repo" / "image-layers").iterdir())) >= 2
    finally:
        svc.close()
