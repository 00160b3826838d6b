"""eStargz layers read lazily straight from their registry (image_loading = "lazy"),
on a real node with real runsc and docker-registry on loopback: a never-seen image
starts with no conversion, reading the footer, the TOC and the chunks it needs by
HTTP range (the registry's own access log counts the bytes); a chunk the registry
serves modified is refused while the node goes on serving; a TOC entry pointing
outside the blob, or a TOC that does not match its digest annotation, fails the
create with a clear error; the converter's output is a plain gzip tar of the same
tree (eStargz's compatibility promise). A plain gzip image is read once to index it
(checkpoints and file table, stored in the node's repository) and then served by range
too; a span the registry serves modified, an index that lies, a blob that does not
match its digest: a clear error, nothing cached of it, the node still serving."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from agentenv.images.estargz import FOOTER_SIZE, TOC_NAME, footer, toc_json, toc_offset_of
from agentenv.images.estargz_build import build_estargz
from agentenv.images.gzip_layer import index_gzip_layer
from agentenv.images.manifest import TOC_DIGEST_ANNOTATION
from agentenv.snapshot.gzip_index import Point
from agentenv.snapshot.layer_index import RegistryBlob, key_of, load
from agentenv.testing import Node, free_cidr, leaks, sdk_env
from agentenv.testing.oci_registry import (
    DEFAULT_PATH,
    Blob,
    Entry,
    RegistryServer,
    build_image,
    digest_of,
    manifest_for,
    tar_layer,
)
from agentenv.testing.oci_registry import (
    TestImage as PushedImage,
)
from test_images_lazy import busybox_layer

PREFIX = f"e{os.getpid() % 4096:03x}"
CIDR = free_cidr(200, 10, os.getpid())  # 10.200-10.209: this file's band
BIG_MIB = 32
PLAIN_BIG_MIB = 12
STALL_S = 4

pytestmark = pytest.mark.skipif(not Path("/bin/busybox").exists(),
                                reason="needs busybox-static")


def data_layer(big: bytes, victim: bytes) -> bytes:
    return tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                      Entry("opt/hello", b"hello from estargz\n"),
                      Entry("opt/big", big), Entry("opt/victim", victim),
                      Entry("opt/link", type=tarfile.SYMTYPE, link="hello"),
                      Entry("opt/attr", b"x", xattrs={"user.note": b"kept"})])


def blob_path(registry: RegistryServer, digest: str) -> Path:
    h = digest.split(":", 1)[1]
    return registry.directory / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / \
        h[:2] / h / "data"


def read_toc(blob: bytes) -> tuple[int, dict]:
    at = toc_offset_of(blob[-FOOTER_SIZE:])
    assert at is not None
    member = zlib.decompressobj(wbits=31).decompress(blob[at:-FOOTER_SIZE])
    return at, json.loads(toc_json(member, "test"))


def with_toc(blob: bytes, toc: dict) -> tuple[bytes, str]:
    """The blob with its TOC replaced (and a footer pointing at it); the TOC's digest."""
    at, _ = read_toc(blob)
    raw = json.dumps(toc).encode()
    info = tarfile.TarInfo(TOC_NAME)
    info.size = len(raw)
    tar = info.tobuf(tarfile.PAX_FORMAT) + raw + bytes(-len(raw) % 512) + bytes(1024)
    member = gzip.compress(tar, mtime=0)
    return blob[:at] + member + footer(at), "sha256:" + hashlib.sha256(raw).hexdigest()


def image_with_top(base: Blob, top: bytes, annotation: str | None) -> PushedImage:
    """An image of ``base`` and an eStargz blob ``top`` (annotated as asked)."""
    layers = [base, Blob(top, base.media_type,
                         {TOC_DIGEST_ANNOTATION: annotation} if annotation else {})]
    diff_ids = [digest_of(gzip.decompress(b.data)) for b in layers]
    config, manifest = manifest_for([b.descriptor() for b in layers], diff_ids,
                                    env=[f"PATH={DEFAULT_PATH}"])
    return PushedImage(layers, config, manifest, diff_ids)


def stored_member(data: bytes, length: int) -> bytes:
    """A gzip member of exactly ``length`` bytes holding a prefix of ``data`` in stored
    deflate blocks (5 bytes of header each): well-formed, other bytes."""
    blocks = -(-length // 65535) + 1
    body = data[:length - 18 - 5 * blocks]
    out = bytearray(b"\x1f\x8b\x08\x00" + bytes(4) + b"\x00\xff")
    pieces = [body[i * len(body) // blocks:(i + 1) * len(body) // blocks] for i in range(blocks)]
    for i, piece in enumerate(pieces):
        out += bytes([1 if i == blocks - 1 else 0]) + len(piece).to_bytes(2, "little") + \
            (0xFFFF ^ len(piece)).to_bytes(2, "little") + piece
    out += zlib.crc32(body).to_bytes(4, "little") + len(body).to_bytes(4, "little")
    assert len(out) == length and zlib.decompress(bytes(out), wbits=31) == body
    return bytes(out)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("images-estargz")
    big, victim = os.urandom(BIG_MIB << 20), os.urandom(1 << 20)
    registry = RegistryServer(tmp / "registry", access_log=True).start()
    try:
        image = build_image([busybox_layer(), data_layer(big, victim)], ["estargz", "estargz"],
                            env=[f"PATH={DEFAULT_PATH}"])
        ref = registry.push("esgz/app", "v1", image)
        # A registry read that stalls fails after 4 s (twice: the read's retry).
        node = Node(tmp / "home", PREFIX, CIDR, AENV_IMAGE_LOADING="lazy",
                    AENV_IMAGE_REGISTRY_TIMEOUT_S=str(STALL_S))
        node.start()
        try:
            with sdk_env(node.e2b_env()):
                yield {"node": node, "registry": registry, "ref": ref, "image": image,
                       "md5_big": hashlib.md5(big).hexdigest(), "victim": victim}
        finally:
            node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def lazy_logs(node: Node) -> str:
    return "".join(p.read_text() for p in (node.home / "cache" / "images" / "lazy" / "logs")
                   .glob("*.log"))


def test_never_seen_estargz_starts_from_a_small_part_of_the_blob(world: dict) -> None:
    node, registry = world["node"], world["registry"]
    image_bytes = sum(len(b.data) for b in world["image"].layers)
    before = registry.blob_bytes_sent("esgz/app")
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=120)
    try:
        out = sbx.commands.run("cat /opt/hello; head -c 5 /opt/big | wc -c; cat /opt/link")
        assert out.stdout.split() == ["hello", "from", "estargz", "5", "hello", "from",
                                      "estargz"]
        fetched = registry.blob_bytes_sent("esgz/app") - before
        # Busybox (~1 MB), two TOCs and the first 4 MiB chunk of /opt/big: not the
        # 33 MiB of /opt.
        assert fetched < 0.25 * image_bytes, (fetched, image_bytes)
        log = node.log_path.read_text()
        assert "is eStargz: served from its registry" in log, log[-3000:]
        assert "converted for lazy loading" not in log
        # Metadata from the TOC: modes, links, xattrs; no TOC or landmark in the tree.
        out = sbx.commands.run("ls -a / /opt; stat -c '%a %s' /opt/big")
        assert "stargz.index.json" not in out.stdout and "landmark" not in out.stdout
        assert out.stdout.strip().endswith(f"644 {BIG_MIB << 20}")
        # The whole file, chunk by chunk from the registry, verified.
        assert sbx.commands.run("md5sum /opt/big").stdout.split()[0] == world["md5_big"]
        assert registry.blob_bytes_sent("esgz/app") - before < image_bytes * 1.1
    finally:
        sbx.kill()


def test_modified_chunk_in_the_registry_refused(world: dict) -> None:
    node, registry = world["node"], world["registry"]
    top = world["image"].layers[1]
    _, toc = read_toc(top.data)
    entry = next(e for e in toc["entries"] if e["name"] == "opt/victim")
    path = blob_path(registry, top.digest)
    good = path.read_bytes()
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # as the image was built
    original = z.compress(world["victim"]) + z.flush()
    start = entry["offset"]
    assert good[start:start + len(original)] == original
    # A well-formed gzip member of other bytes, exactly as long: only the chunk's
    # digest can tell.
    forged = stored_member(os.urandom(len(original)), len(original))
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=120)
    try:
        path.write_bytes(good[:start] + forged + good[start + len(original):])
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("cat /opt/victim > /dev/null")
        assert "Input/output error" in (exc.value.stderr or ""), exc.value.stderr
        log = lazy_logs(node)
        assert "chunk refused (attempt 2 of 2)" in log and "does not match its chunkDigest" \
            in log, log[-3000:]
        # The node goes on serving: this sandbox and a new one.
        assert sbx.commands.run("cat /opt/hello").stdout == "hello from estargz\n"
        path.write_bytes(good)
        out = sbx.commands.run("md5sum /opt/victim")
        assert out.stdout.split()[0] == hashlib.md5(world["victim"]).hexdigest()
    finally:
        path.write_bytes(good)
        sbx.kill()


def _hostile(world: dict, repo: str, change) -> Exception:
    """Push an image whose top layer's TOC ``change`` edits; the create's error."""
    registry = world["registry"]
    base, top = world["image"].layers
    blob, toc_digest = change(top.data)
    ref = registry.push(repo, "v1", image_with_top(base, blob, toc_digest))
    with pytest.raises(Exception) as exc:
        Sandbox.create(template=f"docker://{ref}", timeout=60)
    return exc.value


def test_toc_entry_outside_the_blob_rejected(world: dict) -> None:
    def outside(blob: bytes) -> tuple[bytes, str]:
        at, toc = read_toc(blob)
        for e in toc["entries"]:
            if e["name"] == "opt/hello":
                e["offset"] = at + 10_000_000  # past the TOC, past the blob
        return with_toc(blob, toc)

    err = _hostile(world, "esgz/outside", outside)
    assert "points outside the blob" in str(err) and "opt/hello" in str(err), err
    # The node goes on serving.
    sbx = Sandbox.create(template=f"docker://{world['ref']}", timeout=60)
    try:
        assert sbx.commands.run("cat /opt/hello").stdout == "hello from estargz\n"
    finally:
        sbx.kill()


def test_toc_not_matching_its_annotation_rejected(world: dict) -> None:
    def other_mode(blob: bytes) -> tuple[bytes, str]:
        _, toc = read_toc(blob)
        _, digest = with_toc(blob, toc)  # the TOC as annotated
        for e in toc["entries"]:
            if e["name"] == "opt/hello":
                e["mode"] = 0o104755  # setuid: the TOC edited after the manifest named it
        forged, _ = with_toc(blob, toc)
        return forged, digest

    err = _hostile(world, "esgz/forged", other_mode)
    assert "does not match the layer's TOC digest" in str(err), err


def test_converter_output_is_a_plain_gzip_tar(tmp_path: Path) -> None:
    """``tar -xzf`` of an eStargz layer gives the tree of the tar it was made from
    (plus the TOC and the landmark)."""
    big = os.urandom(9 << 20)  # three chunks
    src = data_layer(big, os.urandom(1000))
    out = io.BytesIO()
    built = build_estargz(io.BytesIO(src), out, chunk_size=4 << 20)
    blob = out.getvalue()
    assert built.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert built.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest()
    _, toc = read_toc(blob)
    assert [e["type"] for e in toc["entries"] if e["name"] == "opt/big"] == \
        ["reg", "chunk", "chunk"]
    (tmp_path / "layer.tar.gz").write_bytes(blob)
    (tmp_path / "layer.tar").write_bytes(src)
    for name, archive, flag in (("esgz", "layer.tar.gz", "-xzf"), ("plain", "layer.tar", "-xf")):
        (tmp_path / name).mkdir()
        subprocess.run(["tar", "--xattrs", "--xattrs-include=user.*", "-C", str(tmp_path / name),
                        flag, str(tmp_path / archive)], check=True, capture_output=True)

    def tree(root: Path) -> dict:
        out = {}
        for p in sorted(root.rglob("*")):
            st = p.lstat()
            rel = str(p.relative_to(root))
            body = os.readlink(p) if p.is_symlink() else \
                hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            xattr = os.getxattr(p, "user.note", follow_symlinks=False) \
                if rel == "opt/attr" else b""
            out[rel] = (st.st_mode, st.st_size if p.is_file() else 0, int(st.st_mtime), body,
                        xattr)
        return out

    esgz = tree(tmp_path / "esgz")
    assert set(esgz) - set(tree(tmp_path / "plain")) == {TOC_NAME, ".no.prefetch.landmark"}
    for name in (TOC_NAME, ".no.prefetch.landmark"):
        del esgz[name]
    assert esgz == tree(tmp_path / "plain")
    assert esgz["opt/attr"][4] == b"kept"


def test_cli_converts_an_image_a_node_then_starts_lazily(world: dict) -> None:
    """``aenv image convert --estargz``: a plain gzip/zstd image in, an eStargz image
    out; a node starts it from the registry without converting it."""
    registry, node = world["registry"], world["node"]
    note = os.urandom(6 << 20)
    plain = registry.push("esgz/plain", "v1", build_image(
        [busybox_layer(), tar_layer([Entry("srv/", type=tarfile.DIRTYPE, mode=0o755),
                                     Entry("srv/note", note, mode=0o600)])],
        ["gzip", "zstd"], env=[f"PATH={DEFAULT_PATH}"]))
    dst = f"{registry.host}/esgz/converted:v1"
    out = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "image", "convert",
                          "--estargz", "--chunk-mib", "2", plain, dst],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(f"{dst}@sha256:"), out.stdout
    assert "layer 2/2" in out.stderr
    before = registry.blob_bytes_sent("esgz/converted")
    sbx = Sandbox.create(template=f"docker://{dst}", timeout=120)
    try:
        got = sbx.commands.run("stat -c %a /srv/note; md5sum /srv/note").stdout.split()
        assert got[:2] == ["600", hashlib.md5(note).hexdigest()]
        log = node.log_path.read_text()
        assert log.count("is eStargz: served from its registry") >= 4, log[-3000:]
        # Busybox and the 6 MiB file in three chunks; nothing read twice.
        assert registry.blob_bytes_sent("esgz/converted") - before < 9 << 20
    finally:
        sbx.kill()


# -- plain gzip layers, through a checkpoint index --------------------------------------


def gzip_data_layer(big: bytes, gap: bytes, victim: bytes) -> bytes:
    return tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                      Entry("opt/hello", b"hello from plain gzip\n"),
                      Entry("opt/big", big), Entry("opt/gap", gap),
                      Entry("opt/victim", victim, mode=0o600),
                      Entry("opt/link", type=tarfile.SYMTYPE, link="hello")])


@pytest.fixture(scope="module")
def plain(world: dict) -> dict:
    """A plain gzip image (no eStargz footer), pushed once."""
    # A gap longer than a span (4 MiB) between /opt/big and /opt/victim: reading the
    # first never fetches the second's span.
    big, gap, victim = (os.urandom(n << 20) for n in (PLAIN_BIG_MIB, 5, 1))
    image = build_image([busybox_layer(), gzip_data_layer(big, gap, victim)],
                        ["gzip", "gzip"], env=[f"PATH={DEFAULT_PATH}"])
    ref = world["registry"].push("gzi/app", "v1", image)
    return {"ref": ref, "image": image, "big": big, "victim": victim}


def repo_index(node: Node, digest: str) -> Path:
    return node.home / "snapshots" / key_of(digest.split(":", 1)[1])


def test_plain_gzip_indexed_once_then_read_by_range(world: dict, plain: dict) -> None:
    node, registry = world["node"], world["registry"]
    image = plain["image"]
    image_bytes = sum(len(b.data) for b in image.layers)
    before = registry.blob_bytes_sent("gzi/app")
    sbx = Sandbox.create(template=f"docker://{plain['ref']}", timeout=120)
    try:
        out = sbx.commands.run("cat /opt/link; stat -c '%a %s' /opt/victim")
        assert out.stdout.split() == ["hello", "from", "plain", "gzip", "600", str(1 << 20)]
        log = node.log_path.read_text()
        assert log.count("indexed for lazy loading from its registry") == 2, log[-3000:]
        assert "converted for lazy loading" not in log
        # Each layer was read once, whole, to index it; then only ranges.
        indexed = registry.blob_bytes_sent("gzi/app") - before
        assert image_bytes <= indexed < image_bytes + (8 << 20), (indexed, image_bytes)
        # The index is in the repository, for every other node: checkpoints every few
        # MiB of the 18 MiB tar, and the layer's digest.
        top = image.layers[1]
        index = load(repo_index(node, top.digest).read_bytes(), "test")
        assert index.layer == top.digest and index.gzip is not None
        assert 3 <= len(index.gzip.points) <= 6, len(index.gzip.points)
        assert index.entries["opt/victim"].size == 1 << 20
        # A read fetches the spans it needs, not the blob.
        mark = registry.blob_bytes_sent("gzi/app")
        assert sbx.commands.run("head -c 5 /opt/big | wc -c").stdout.strip() == "5"
        assert registry.blob_bytes_sent("gzi/app") - mark < 6 << 20
        assert sbx.commands.run("md5sum /opt/big").stdout.split()[0] == \
            hashlib.md5(plain["big"]).hexdigest()
        assert registry.blob_bytes_sent("gzi/app") - mark < (PLAIN_BIG_MIB + 6) << 20
    finally:
        sbx.kill()


def test_modified_gzip_span_refused_nothing_cached(world: dict, plain: dict) -> None:
    node, registry = world["node"], world["registry"]
    top = plain["image"].layers[1]
    index = load(repo_index(node, top.digest).read_bytes(), "test")
    assert index.gzip is not None
    entry = index.entries["opt/victim"]
    k = index.gzip.span_of(entry.spans[0][0])
    start, length, _, _ = index.gzip.span_range(k)
    path = blob_path(registry, top.digest)
    good = path.read_bytes()
    # Random data is stored as is: bytes changed in the middle of its span still
    # inflate; only the chunk's sha256 can tell.
    at = start + length // 2
    path.write_bytes(good[:at] + os.urandom(64) + good[at + 64:])
    chunks = node.home / "cache" / "images" / "lazy" / "chunks"
    sbx = Sandbox.create(template=f"docker://{plain['ref']}", timeout=120)
    try:
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("cat /opt/victim > /dev/null")
        assert "Input/output error" in (exc.value.stderr or ""), exc.value.stderr
        log = lazy_logs(node)
        assert "chunk refused (attempt 2 of 2)" in log and \
            "does not match its digest in the layer's index" in log, log[-3000:]
        assert not any((chunks / d[:2] / d).exists() for d, _ in entry.chunks)
        assert sbx.commands.run("cat /opt/hello").stdout == "hello from plain gzip\n"
        path.write_bytes(good)  # repaired: fetched again, intact
        out = sbx.commands.run("md5sum /opt/victim")
        assert out.stdout.split()[0] == hashlib.md5(plain["victim"]).hexdigest()
    finally:
        path.write_bytes(good)
        sbx.kill()


def test_lying_gzip_index_and_tampered_blob_rejected(world: dict, plain: dict) -> None:
    node, registry = world["node"], world["registry"]
    base = plain["image"].layers[0]
    top_tar = tar_layer([Entry("srv/", type=tarfile.DIRTYPE, mode=0o755),
                         Entry("srv/data", os.urandom(6 << 20))])

    def push(repo: str) -> tuple[str, Blob]:
        image = build_image([gzip.decompress(base.data), top_tar], ["gzip", "gzip"],
                            env=[f"PATH={DEFAULT_PATH}"])
        return registry.push(repo, "v1", image), image.layers[1]

    def create_error(ref: str) -> str:
        with pytest.raises(Exception) as exc:
            Sandbox.create(template=f"docker://{ref}", timeout=60)
        return str(exc.value)

    ref, top = push("gzi/lie")
    blob = RegistryBlob(registry.host, "gzi/lie", top.digest, len(top.data), len(top.data))
    honest = index_gzip_layer(iter([top.data]), blob, spacing=1 << 20)
    assert honest.gzip is not None and len(honest.gzip.points) >= 3
    # A checkpoint past the blob's end.
    honest.gzip.points[2] = Point(len(top.data) * 8 + 100, honest.gzip.points[2].out, False)
    repo_index(node, top.digest).write_bytes(honest.dump())
    err = create_error(ref)
    assert "points outside the blob" in err, err
    # The index of another layer, planted under this one's key.
    other = plain["image"].layers[1]
    repo_index(node, top.digest).write_bytes(repo_index(node, other.digest).read_bytes())
    err = create_error(ref)
    assert f"its index is of layer {other.digest!r}" in err, err
    assert not (node.home / "cache" / "images" / "lazy" / "index" /
                f"{top.digest.split(':')[1]}.json.zst").exists()
    repo_index(node, top.digest).unlink()
    # A blob whose bytes do not match its digest: refused while indexing, no index kept.
    ref, top = push("gzi/tampered")
    path = blob_path(registry, top.digest)
    path.write_bytes(top.data[:-64] + os.urandom(64))
    err = create_error(ref)
    assert "digest mismatch" in err or "corrupt" in err, err
    assert not repo_index(node, top.digest).exists()
    # The node goes on serving.
    sbx = Sandbox.create(template=f"docker://{plain['ref']}", timeout=60)
    try:
        assert sbx.commands.run("cat /opt/hello").stdout == "hello from plain gzip\n"
    finally:
        sbx.kill()


class StallingProxy:
    """A TCP proxy in front of the registry; ``stall`` lets each answer's first 64 KiB
    through and then sends nothing more (a registry stuck mid-range) until cleared."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.stall = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        allowed = 64 << 10
        try:
            while data := src.recv(1 << 16):
                if answers and self.stall.is_set():
                    dst.sendall(data[:allowed])
                    allowed -= min(allowed, len(data))
                    while self.stall.is_set():
                        time.sleep(0.05)
                    data = data[allowed:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.server.close()


def test_registry_stalling_mid_range_fails_the_read_only(world: dict, plain: dict) -> None:
    """An image through a proxy that stalls: a read of a file not yet fetched fails
    with EIO after the timeout (nothing cached of it), other reads and the node go on;
    once the registry answers again, the file reads intact."""
    node, registry = world["node"], world["registry"]
    data = os.urandom(5 << 20)
    image = build_image([gzip.decompress(plain["image"].layers[0].data), tar_layer([
        Entry("srv/", type=tarfile.DIRTYPE, mode=0o755), Entry("srv/hello", b"hi\n"),
        Entry("srv/data", data)])], ["gzip", "gzip"], env=[f"PATH={DEFAULT_PATH}"])
    proxy = StallingProxy(registry.host)
    ref = registry.push("gzi/stall", "v1", image).replace(registry.host, proxy.host)
    chunks = node.home / "cache" / "images" / "lazy" / "chunks"
    sbx = Sandbox.create(template=f"docker://{ref}", timeout=120)
    gap = load(repo_index(node, image.layers[1].digest).read_bytes(), "t").entries["srv/data"]
    try:
        assert sbx.commands.run("cat /srv/hello").stdout == "hi\n"
        proxy.stall.set()
        t0 = time.monotonic()
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("cat /srv/data > /dev/null", timeout=120)
        assert "Input/output error" in (exc.value.stderr or ""), exc.value.stderr
        assert time.monotonic() - t0 >= STALL_S
        assert proxy.host in lazy_logs(node) and "ReadTimeout" in lazy_logs(node)
        assert not any((chunks / d[:2] / d).exists() for d, _ in gap.chunks)
        assert sbx.commands.run("cat /srv/hello").stdout == "hi\n"  # read before
        proxy.stall.clear()
        # Reads the kernel still had in flight may time out a little later; a read
        # after them fetches the file intact.
        deadline = time.monotonic() + 30
        while True:
            try:
                out = sbx.commands.run("md5sum /srv/data")
                break
            except CommandExitException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert out.stdout.split()[0] == hashlib.md5(data).hexdigest()
    finally:
        proxy.stall.clear()
        sbx.kill()
        proxy.close()


def test_gzip_checkpoints_resume_anywhere() -> None:
    """Every file of a two-member gzip tar (text and random data: Huffman and stored
    blocks) read back from its checkpoints alone; checkpoints inside a byte among them."""
    from agentenv.snapshot.gzip_index import inflate_span
    files = {f"d/f{i}": (os.urandom(200_000) if i % 3 else b"line %d\n" % i * 30_000)
             for i in range(24)}
    tar = tar_layer([Entry("d/", type=tarfile.DIRTYPE, mode=0o755)] +
                    [Entry(name, data) for name, data in files.items()])
    half = len(tar) // 2
    blob = gzip.compress(tar[:half], 6) + gzip.compress(tar[half:], 1)
    where = RegistryBlob("r", "x", digest_of(blob), len(blob), len(blob))
    index = load(index_gzip_layer(iter([blob]), where, spacing=64 << 10).dump(), "t")
    g = index.gzip
    assert g is not None and len(g.points) > 40
    assert any(p.bit % 8 for p in g.points) and sum(p.member for p in g.points) == 2
    spans = {k: inflate_span(g, k, blob[s:s + n])
             for k in range(len(g.points)) for s, n, _, _ in [g.span_range(k)]}
    assert b"".join(spans[k] for k in range(len(g.points))) == tar
    for name, data in files.items():
        e = index.entries[name]
        got = b""
        for (d, n), (at, _, _) in zip(e.chunks, e.spans, strict=True):
            k = g.span_of(at)
            piece = b"".join(spans[i] for i in range(k, len(g.points)))[
                at - g.points[k].out:at - g.points[k].out + n]
            assert hashlib.sha256(piece).hexdigest() == d
            got += piece
        assert got == data, name
