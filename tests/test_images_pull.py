"""Pulling images from a real registry (docker-registry on loopback), an OCI layout and a
docker archive into the layer store; overlay rootfs mounts; the bounded cache."""

from __future__ import annotations

import json
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.images import (
    CacheTooSmall,
    ImageNotFound,
    ImageService,
    LayerStore,
    RegistryAuthError,
    RegistryUnavailable,
    mounted_under,
)
from agentenv.templates import TemplateRegistry
from agentenv.testing.oci_registry import (
    Entry,
    RegistryServer,
    build_image,
    tar_layer,
    write_docker_archive,
    write_oci_layout,
)

D, L, H, S = tarfile.DIRTYPE, tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.SYMTYPE
BOTTOM = tar_layer([
    Entry("etc/", type=D, mode=0o755), Entry("etc/gone", b"whited out"),
    Entry("etc/kept", b"kept"),
    Entry("data/", type=D, mode=0o755), Entry("data/old1", b"1"), Entry("data/old2", b"2"),
    Entry("bin/", type=D, mode=0o755),
    Entry("bin/suid", b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0),
    Entry("home/", type=D, mode=0o755),
    Entry("home/user/", type=D, mode=0o700, uid=1000, gid=1000),
    Entry("home/user/notes", b"mine", mode=0o600, uid=1000, gid=1000,
          xattrs={"user.origin": b"layer-1"}),
    Entry("dev/", type=D, mode=0o755),
    Entry("dev/sda", type=tarfile.BLKTYPE, devmajor=8, devminor=0),
    Entry("dev/mem", type=tarfile.CHRTYPE, devmajor=1, devminor=1),
])
TOP = tar_layer([
    Entry("etc/.wh.gone"),
    Entry("data/.wh..wh..opq"), Entry("data/new", b"new"),
    Entry("etc/kept-link", type=S, link="kept"),
    Entry("etc/abs-link", type=S, link="/etc/passwd"),  # fine: resolved inside the sandbox
    Entry("etc/hard", type=L, link="data/new"),
    Entry("ro/", type=D, mode=0o555), Entry("ro/inside", b"x", mode=0o444),
])
ARM = tar_layer([Entry("arm64-only", b"wrong platform")])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    with RegistryServer(tmp_path_factory.mktemp("registry")) as server:
        yield server


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    with RegistryServer(tmp_path_factory.mktemp("auth-registry"), auth=True) as server:
        yield server


def service(tmp: Path, budget: int = 1 << 30, in_use: set[str] | None = None,
            pinned: tuple[str, ...] = ()) -> ImageService:
    templates = TemplateRegistry(tmp / "builtin", tmp / "local", tmp / "rootfs")
    svc = ImageService(LayerStore(tmp / "cache", budget), templates, tmp / "secrets",
                       in_use=lambda: set(in_use or ()), pinned=pinned)
    svc.start()
    return svc


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ImageService]:
    s = service(tmp_path)
    yield s
    s.close()
    assert mounted_under(tmp_path) == []


def check_tree(root: Path) -> None:
    """What a sandbox of the two-layer image sees."""
    assert not (root / "etc/gone").exists()  # whiteout
    assert (root / "etc/kept").read_text() == "kept"
    assert sorted(os.listdir(root / "data")) == ["new"]  # opaque directory
    st = os.stat(root / "bin/suid")
    assert stat.S_IMODE(st.st_mode) == 0o4755
    st = os.stat(root / "home/user/notes")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o600)
    assert stat.S_IMODE(os.stat(root / "home/user").st_mode) == 0o700
    assert os.getxattr(root / "home/user/notes", "user.origin") == b"layer-1"
    assert os.readlink(root / "etc/kept-link") == "kept"
    assert os.readlink(root / "etc/abs-link") == "/etc/passwd"
    assert os.stat(root / "etc/hard").st_ino == os.stat(root / "data/new").st_ino
    assert stat.S_IMODE(os.stat(root / "ro").st_mode) == 0o555
    assert os.listdir(root / "dev") == []  # device nodes never reach a rootfs
    assert not (root / "arm64-only").exists()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755


def test_registry_index_gzip_zstd(registry: RegistryServer, svc: ImageService) -> None:
    image = build_image([BOTTOM, TOP], ["gzip", "zstd"])
    ref = registry.push_index("lib/two", "v1", {"amd64": image,
                                                "arm64": build_image([ARM], ["gzip"],
                                                                     arch="arm64")})
    events: list[dict] = []
    record = svc.pull(ref, "two", progress=events.append)
    assert record["image"]["manifestDigest"] == image.manifest.digest  # the amd64 entry
    assert [x["digest"] for x in record["image"]["layers"]] == [b.digest for b in image.layers]
    assert events[-1]["status"] == "done"
    assert {e["digest"] for e in events if e["status"] == "done-layer"} == \
        {b.digest for b in image.layers}
    template = svc.templates.get("two")
    root = svc.ensure(template)
    assert os.path.ismount(root)
    check_tree(root)
    # Read-only to the host too: each sandbox writes to its own upper layer only.
    with pytest.raises(OSError):
        (root / "etc/new").write_text("x")
    # A second pull of the same image fetches nothing.
    again: list[dict] = []
    svc.pull(f"{ref.rsplit(':', 1)[0]}@{image.manifest.digest}", "two-by-digest",
             progress=again.append)
    assert not [e for e in again if e["status"] == "done-layer"]
    assert svc.ensure(svc.templates.get("two-by-digest")) == root  # one mount per image
    assert {i["name"] for i in svc.list()} == {"two", "two-by-digest"}


def test_docker_schema2_and_not_found(registry: RegistryServer, svc: ImageService) -> None:
    ref = registry.push("lib/docker", "v2", build_image([BOTTOM, TOP], docker_types=True))
    svc.pull(ref, "docker")
    check_tree(svc.ensure(svc.templates.get("docker")))
    with pytest.raises(ImageNotFound, match="not found"):
        svc.pull(ref.replace(":v2", ":nope"), "nope")
    with pytest.raises(ImageNotFound, match="no linux/amd64"):
        svc.pull(registry.push_index("lib/armonly", "v1", {
            "arm64": build_image([ARM], arch="arm64")}), "armonly")
    with pytest.raises(RegistryUnavailable):
        svc.pull("127.0.0.1:9/lib/x:v1", "down")
    assert not (svc.templates.local_dir / "nope").exists()


def test_token_auth(auth_registry: RegistryServer, tmp_path: Path) -> None:
    ref = auth_registry.push("private/app", "v1", build_image([BOTTOM, TOP]))
    svc = service(tmp_path)
    try:
        with pytest.raises(RegistryAuthError):
            svc.pull(ref, "anon")
        with pytest.raises(RegistryAuthError, match="refused"):
            svc.pull(ref, "wrong", {"username": auth_registry.username, "password": "bad"})
        creds = {"username": auth_registry.username, "password": auth_registry.password}
        issued = auth_registry.tokens.issued
        svc.pull(ref, "private", creds)
        assert auth_registry.tokens.issued > issued
        secret = tmp_path / "secrets/images/private.json"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert auth_registry.password not in (tmp_path / "local/private/template.json").read_text()
        # Evicted layers come back with the stored credentials.
        template = svc.templates.get("private")
        for digest, _ in template.image.layers:
            svc.store.remove(digest.split(":")[1])
        check_tree(svc.ensure(template))
    finally:
        svc.close()


def test_oci_layout_and_docker_archive(tmp_path: Path, svc: ImageService) -> None:
    image = build_image([BOTTOM, TOP], ["zstd", "gzip"])
    layout = write_oci_layout(tmp_path / "layout", image, tag="v3")
    svc.pull(f"oci-layout:{layout}:v3", "layout")
    check_tree(svc.ensure(svc.templates.get("layout")))
    with pytest.raises(ImageNotFound, match="no image tagged"):
        svc.pull(f"oci-layout:{layout}:v4", "layout4")
    index_layout = write_oci_layout(
        tmp_path / "index-layout", image, index=__import__(
            "agentenv.testing.oci_registry", fromlist=["build_index"]).build_index(
                {"amd64": image}))
    svc.pull(f"oci-layout:{index_layout}", "layout-index")
    archive = write_docker_archive(tmp_path / "saved.tar", [BOTTOM, TOP])
    svc.pull(f"docker-archive:{archive}", "archive")
    check_tree(svc.ensure(svc.templates.get("archive")))


def big_layer(seed: int, mib: int) -> bytes:
    return tar_layer([Entry(f"blob{seed}", os.urandom(mib << 20))])


def test_budget_evicts_lru_unused_layers(tmp_path: Path, registry: RegistryServer) -> None:
    refs = [registry.push(f"lib/big{i}", "v1", build_image([BOTTOM, big_layer(i, 4)],
                                                           ["gzip", "tar"]))
            for i in range(3)]
    in_use: set[str] = set()
    svc = service(tmp_path, budget=9 << 20, in_use=in_use, pinned=("big0",))
    try:
        with pytest.raises(CacheTooSmall):
            service(tmp_path / "tiny", budget=1 << 20).pull(refs[0], "tiny")
        svc.pull(refs[0], "big0")
        svc.pull(refs[1], "big1")
        in_use.add("big1")
        root1 = svc.ensure(svc.templates.get("big1"))
        # big2 does not fit next to both, and big0 is pinned, big1 in use: the only
        # layer the budget lets go is big2's own top layer.
        svc.pull(refs[2], "big2")
        cached = {i["name"]: i["cachedLayers"] for i in svc.list()}
        assert cached == {"big0": 2, "big1": 2, "big2": 1}
        assert svc.store.total() <= svc.store.budget
        assert os.path.ismount(root1)
        # big2 starts (its layer comes back); big1, no longer used, is now the least
        # recently used: its top layer goes, and its rootfs is unmounted with it.
        in_use.clear()
        in_use.add("big2")
        svc.ensure(svc.templates.get("big2"))
        cached = {i["name"]: i["cachedLayers"] for i in svc.list()}
        assert cached == {"big0": 2, "big1": 1, "big2": 2}
        assert not os.path.ismount(root1)
        # With both in use the cache goes over budget rather than fail a template.
        in_use.add("big1")
        root1 = svc.ensure(svc.templates.get("big1"))
        assert (root1 / "blob1").stat().st_size == 4 << 20
        assert svc.store.total() > svc.store.budget
        # The shared bottom layer is stored once.
        assert len(svc.store.stored()) <= 4
    finally:
        svc.close()


def test_crash_leftovers_cleaned(tmp_path: Path, registry: RegistryServer) -> None:
    ref = registry.push("lib/crash", "v1", build_image([BOTTOM, TOP]))
    svc = service(tmp_path)
    svc.pull(ref, "crash")
    root = svc.ensure(svc.templates.get("crash"))
    # A crash: a half-unpacked layer, a layer without metadata, a mount left behind.
    (tmp_path / "cache/tmp/abc.half").mkdir()
    (tmp_path / "cache/tmp/abc.half/file").write_text("x")
    (tmp_path / "cache/layers" / ("f" * 64)).mkdir()
    again = service(tmp_path)  # the next start
    try:
        assert list((tmp_path / "cache/tmp").iterdir()) == []
        assert not (tmp_path / "cache/layers" / ("f" * 64)).exists()
        assert not os.path.ismount(root)
        check_tree(again.ensure(again.templates.get("crash")))
        meta = json.loads(next((tmp_path / "cache/meta").glob("*.json")).read_text())
        assert meta["size"] > 0
    finally:
        again.close()
        svc.close()


def test_cancelled_pull_leaves_nothing(registry: RegistryServer, svc: ImageService,
                                       tmp_path: Path) -> None:
    import threading

    from agentenv.images import PullCancelled

    ref = registry.push("lib/cancel", "v1", build_image([big_layer(9, 8)], ["gzip"]))
    cancel = threading.Event()

    def progress(event: dict) -> None:
        if event["status"] == "downloading":
            cancel.set()  # as the API does when the client hangs up

    with pytest.raises(PullCancelled):
        svc.pull(ref, "cancelled", progress=progress, cancel=cancel)
    assert list((tmp_path / "cache/tmp").iterdir()) == []
    assert svc.store.stored() == {}
    assert not (tmp_path / "local/cancelled").exists()


def test_many_layers(tmp_path: Path, svc: ImageService) -> None:
    """More layers than their names fit in one page of mount options."""
    tars = [tar_layer([Entry(f"f{i:03d}", str(i).encode()), Entry("top", str(i).encode())])
            for i in range(100)]
    layout = write_oci_layout(tmp_path / "many", build_image(tars, ["zstd"] * 100))
    svc.pull(f"oci-layout:{layout}", "many")
    root = svc.ensure(svc.templates.get("many"))
    assert (root / "top").read_text() == "99"  # the top layer wins
    assert len([p for p in root.iterdir() if p.name.startswith("f")]) == 100
    assert list((tmp_path / "cache/tmp").iterdir()) == []


def test_docker_archive_layers_read_at_once_stay_whole(tmp_path: Path) -> None:
    """A pull fetches layers in several threads; an archive's layers share one file."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from agentenv.images.reference import parse_reference
    from agentenv.images.sources import ArchiveSource

    layers = [tar_layer([Entry(f"blob{i}", os.urandom(3 << 20))]) for i in range(4)]
    archive = write_docker_archive(tmp_path / "saved.tar", layers)
    source = ArchiveSource(parse_reference(f"docker-archive:{archive}"))  # type: ignore[arg-type]
    image = source.resolve()

    def digest(layer) -> str:
        h = hashlib.sha256()
        with source.layer(layer) as chunks:
            for chunk in chunks:
                h.update(chunk)
        return "sha256:" + h.hexdigest()

    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(digest, image.layers)) == [x.digest for x in image.layers]
