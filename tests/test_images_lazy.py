"""Lazily loaded images (image_loading = "lazy") on a real node with real runsc: a
sandbox created from a never-seen image starts once the layers' indexes exist and
reads file contents on demand through the layers' FUSE mounts; a corrupt chunk in
the repository is refused (and read again once repaired); an index pointing outside
its data is rejected; a second node on a shared (S3) repository starts the image
without converting it; crashes and dead servers are cleaned up; no mount or server
outlives the node."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from agentenv.images.mounts import mounted_under
from agentenv.snapshot.chunking import compress
from agentenv.snapshot.layer_index import Entry as IndexEntry
from agentenv.snapshot.layer_index import LayerIndex, key_of, load
from agentenv.testing import Node, free_cidr, leaks, sdk_env, serving
from agentenv.testing.oci_registry import (
    BUSYBOX,
    DEFAULT_PATH,
    Entry,
    RegistryServer,
    build_image,
    busybox_layer,
    digest_of,
    tar_layer,
)
from test_snapshot_store import S3Server  # moto's S3 server, as the oss tests use it

PREFIX = f"z{os.getpid() % 4096:03x}"
CIDR = free_cidr(102, 18, os.getpid())  # 10.102-10.119: this file's band
BIG_MIB = 24
BUDGET = 16 << 20  # the node's cache budget: smaller than /opt/big

pytestmark = pytest.mark.skipif(not BUSYBOX.exists(), reason="needs busybox-static")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("images-lazy")
    big = os.urandom(BIG_MIB << 20)
    other = os.urandom(3 << 20)
    unread = os.urandom(1 << 20)  # read first after a crash of the node
    data = tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                      Entry("opt/hello", b"hello lazily\n"),
                      Entry("opt/big", big), Entry("opt/other", other),
                      Entry("opt/unread", unread)])
    registry = RegistryServer(tmp / "registry").start()
    try:
        base = busybox_layer()
        ref = registry.push("lazy/app", "v1", build_image(
            [base, data], ["gzip", "zstd"], env=[f"PATH={DEFAULT_PATH}"]))
        # A second image whose top layer's index the test plants, broken, in the repository.
        bad_top = tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                             Entry("opt/x", b"x" * 1000)])
        bad_ref = registry.push("lazy/bad", "v1", build_image([base, bad_top], ["tar", "tar"]))
        # A small one for the S3 repository (moto is slow per request).
        small = os.urandom(1 << 20)
        small_ref = registry.push("lazy/small", "v1", build_image([base, tar_layer([
            Entry("opt/", type=tarfile.DIRTYPE, mode=0o755), Entry("opt/small", small)])],
            ["gzip", "gzip"]))
        node = Node(tmp / "home", PREFIX, CIDR, AENV_IMAGE_LOADING="lazy",
                    AENV_LOCAL_CACHE_BYTES=str(BUDGET))
        node.start()
        try:
            with sdk_env(node.e2b_env()):
                yield {"node": node, "ref": ref, "bad_ref": bad_ref, "bad_top": bad_top,
                       "small_ref": small_ref, "md5_small": hashlib.md5(small).hexdigest(),
                       "md5_unread": hashlib.md5(unread).hexdigest(),
                       "md5_big": hashlib.md5(big).hexdigest(), "image_bytes": len(base) +
                       len(data), "other": other}
        finally:
            node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def lazy_root(node: Node) -> Path:
    return node.home / "cache" / "images" / "lazy"


def cached_bytes(node: Node) -> int:
    return sum(p.stat().st_size for p in (lazy_root(node) / "chunks").rglob("*") if p.is_file())


def test_lazy_start_reads_on_demand(world: dict) -> None:
    node = world["node"]
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=120)
    try:
        before = cached_bytes(node)
        out = sbx.commands.run("cat /opt/hello; head -c 5 /opt/big | wc -c")
        assert out.stdout.split() == ["hello", "lazily", "5"]
        # The sandbox started without the 27 MiB of /opt: what its boot and first
        # command read is a small fraction of the image (busybox, mostly).
        assert before < 0.25 * world["image_bytes"], (before, world["image_bytes"])
        assert cached_bytes(node) < 0.25 * world["image_bytes"]
        assert sbx.commands.run("md5sum /opt/big").stdout.split()[0] == world["md5_big"]
        # Past the budget: cold chunks go (the running sandbox's too), within a sweep.
        deadline = time.monotonic() + 30
        while "image chunks" not in node.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert re.search(r"evicted \d+ image chunks", node.log_path.read_text())
        # (the sweep that logged it may be followed by one more on a busy machine)
        while cached_bytes(node) >= BIG_MIB << 20 and time.monotonic() < deadline + 30:
            time.sleep(0.5)
        assert cached_bytes(node) < BIG_MIB << 20
        # Read again (the page cache, or fetched again): the same bytes.
        assert sbx.commands.run("md5sum /opt/big").stdout.split()[0] == world["md5_big"]
        log = node.log_path.read_text()
        assert "converted for lazy loading" in log and "mounted lazily" in log
        # Two layers, each one FUSE mount, stacked under the rootfs overlay.
        assert len(mounted_under(lazy_root(node) / "mnt")) == 2
    finally:
        sbx.kill()


def _layer_hex(node: Node, path: str) -> tuple[str, LayerIndex]:
    """The (converted) layer holding ``path`` and its index, read from the repository."""
    for f in (node.home / "snapshots" / "image-layers").iterdir():
        index = load(f.read_bytes(), f.name)
        if path in index.entries:
            return f.name.split(".")[0], index
    raise AssertionError(f"no layer index lists {path}")


def test_corrupt_chunk_refused_then_refetched(world: dict) -> None:
    node = world["node"]
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=120)
    _, index = _layer_hex(node, "opt/other")
    digest, size = index.entries["opt/other"].chunks[0]
    chunk = node.home / "snapshots" / "chunks" / digest[:2] / digest
    good = chunk.read_bytes()
    try:
        # Well-formed zstd of other bytes: only the blake3 check can tell.
        chunk.write_bytes(compress(b"\xff" * size))
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("cat /opt/other > /dev/null")
        assert "Input/output error" in (exc.value.stderr or ""), exc.value.stderr
        log = (lazy_root(node) / "logs" / f"{_layer_hex(node, 'opt/other')[0]}.log").read_text()
        assert "chunk refused (attempt 2 of 2)" in log and "does not match" in log, log
        # The node still serves, and the repaired chunk is fetched again on the next read.
        chunk.write_bytes(good)
        out = sbx.commands.run("md5sum /opt/other")
        assert out.stdout.split()[0] == hashlib.md5(world["other"]).hexdigest()
        assert sbx.commands.run("cat /opt/hello").stdout == "hello lazily\n"
    finally:
        chunk.write_bytes(good)
        sbx.kill()


def test_index_outside_its_data_rejected(world: dict) -> None:
    node = world["node"]
    h = digest_of(world["bad_top"]).split(":", 1)[1]  # an uncompressed layer: same digest
    bogus = LayerIndex(f"sha256:{h}", f"sha256:{h}", {
        "": IndexEntry("d"), "opt": IndexEntry("d"),
        # 1000 bytes, one chunk of 4096: the index points past the file's data.
        "opt/x": IndexEntry("f", mode=0o644, size=1000, chunks=[("a" * 64, 4096)])})
    repo_key = node.home / "snapshots" / key_of(h)
    repo_key.write_bytes(bogus.dump())
    with pytest.raises(Exception) as exc:
        Sandbox.create(template=f"docker://{world['bad_ref']}", timeout=60)
    assert "points outside its data" in str(exc.value), exc.value
    # Nothing of it was mounted, and the node goes on serving.
    assert len(mounted_under(lazy_root(node) / "mnt")) <= 2
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=60)
    try:
        assert sbx.commands.run("cat /opt/hello").stdout == "hello lazily\n"
    finally:
        sbx.kill()


def test_oss_repository_and_a_second_node(world: dict, tmp_path: Path) -> None:
    """Two nodes on one S3-compatible repository: the first indexes the image's plain
    gzip layers (checkpoints and file table, stored in the repository), the second
    starts it from that index, reading only ranges of the registry's blobs."""
    s3 = S3Server()
    s3.start()
    try:
        for name in ("key-id", "secret"):
            (tmp_path / name).write_text("test")
            os.chmod(tmp_path / name, 0o600)
        repo = {"AENV_SNAPSHOT_BACKEND": "oss", "AENV_SNAPSHOT_ENDPOINT_URL": s3.url,
                "AENV_SNAPSHOT_BUCKET": s3.new_bucket(), "AENV_SNAPSHOT_PREFIX": "shared",
                "AENV_SNAPSHOT_REGION": "us-east-1",
                "AENV_SNAPSHOT_ACCESS_KEY_ID_FILE": str(tmp_path / "key-id"),
                "AENV_SNAPSHOT_SECRET_ACCESS_KEY_FILE": str(tmp_path / "secret"),
                # No boot image (a capture committed to moto would take most of the time).
                "AENV_IMAGE_LOADING": "lazy", "AENV_TEMPLATE_SNAPSHOTS": "false"}
        for i in (1, 2):
            node = Node(tmp_path / f"node{i}", f"{PREFIX[:-1]}o{i}",
                        free_cidr(102, 18, os.getpid() + i), **repo)
            with serving(node):
                sbx = Sandbox.create(template=f"docker://{world['small_ref']}", timeout=60)
                try:
                    out = sbx.commands.run("md5sum /opt/small")
                    assert out.stdout.split()[0] == world["md5_small"]
                finally:
                    sbx.kill()
                log = node.log_path.read_text()
                assert "converted for lazy loading" not in log
                indexed = log.count("indexed for lazy loading from its registry")
                assert indexed == (2 if i == 1 else 0), log[-3000:]  # the first's index
            # The first node's servers recorded what its first run read (at unmount);
            # the second's fetched it ahead, /opt/small among it.
            layer_logs = "".join(p.read_text() for p in (lazy_root(node) / "logs").iterdir())
            if i == 1:
                assert layer_logs.count("recorded the first run's") == 2, layer_logs[-3000:]
            else:
                assert "recorded the first run's" not in layer_logs
                assert re.search(r"prefetched 1 files of the first run \((1048576|\d{7,}) "
                                 "bytes", layer_logs), layer_logs[-3000:]
    finally:
        s3.stop()


def test_dead_layer_server_is_replaced(world: dict) -> None:
    node = world["node"]
    Sandbox.create(template=f"docker://{world['ref']}", timeout=60).kill()  # layers mounted
    pids = subprocess.run(["pgrep", "-f", f"agentenv.images.lazyfs {lazy_root(node)}"],
                          capture_output=True, text=True).stdout.split()
    assert len(pids) == 2
    os.kill(int(pids[0]), 9)  # one of this node's layer servers dies
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=60)
    try:
        assert sbx.commands.run("cat /opt/hello; md5sum /opt/big").stdout.split()[:3] == [
            "hello", "lazily", world["md5_big"]]
    finally:
        sbx.kill()
    assert "died; mounting its rootfs again" in node.log_path.read_text()


def test_restart_after_crash_keeps_live_layers_and_unmounts_stale_ones(world: dict) -> None:
    node = world["node"]
    mnt = lazy_root(node) / "mnt"
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=120)
    before = mounted_under(mnt)
    assert len(before) == 2
    # A crash with a sandbox running: its layers' servers outlive the node and stay.
    node.kill9()
    node.start()
    assert mounted_under(mnt) == before
    out = sbx.commands.run("md5sum /opt/unread")  # never read before: fetched now
    assert out.stdout.split()[0] == world["md5_unread"]
    sbx.kill()
    # A crash with none running: at the restart its layer mounts are stale and go.
    node.kill9()
    assert mounted_under(mnt) == before
    node.start()
    assert mounted_under(mnt) == []
    assert "removing stale lazy layer mount" in node.log_path.read_text()
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=60)
    try:
        assert sbx.commands.run("cat /opt/hello").stdout == "hello lazily\n"
    finally:
        sbx.kill()


def test_node_stop_unmounts_layers(world: dict) -> None:
    node = world["node"]
    assert mounted_under(lazy_root(node) / "mnt")
    node.stop()
    assert mounted_under(node.home) == []
    servers = subprocess.run(["pgrep", "-f", f"agentenv.images.lazyfs {lazy_root(node)}"],
                             capture_output=True, text=True).stdout.split()
    assert servers == []
    # Opening is no round trip to the servers (the kernel's no-open mode): each one
    # was asked once, and never to release, over every read of this module's sandboxes.
    for log in (lazy_root(node) / "logs").glob("*.log"):
        ends = re.findall(r"requests: (\{.*\})", log.read_text())
        assert ends, log.read_text()[-2000:]
        counts = json.loads(ends[-1])
        assert counts.get("open", 0) <= 1 and "release" not in counts, (log.name, counts)
        assert counts.get("opendir", 0) <= 1 and "releasedir" not in counts, (log.name, counts)
    assert Path("/dev/fuse").exists()  # the set-up installs fuse3
