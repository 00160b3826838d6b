"""Hostile images: every crafted archive is refused with a clear error, and nothing is
written outside the layer store (nor left half-written inside it)."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.images import BadReference, HostileInput, ImageService, LayerStore
from agentenv.templates import TemplateRegistry
from agentenv.testing.oci_registry import (
    Blob,
    Entry,
    build_image,
    tar_layer,
    write_docker_archive,
    write_oci_layout,
)

SYM, LNK, DIR = tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE
OUTSIDE = Path("/tmp/aenv-images-escape-test")


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ImageService]:
    templates = TemplateRegistry(tmp_path / "builtin", tmp_path / "local", tmp_path / "rootfs")
    s = ImageService(LayerStore(tmp_path / "cache", 64 << 20), templates, tmp_path / "secrets")
    s.start()
    yield s
    s.close()


def everything(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if not str(p.relative_to(root)).startswith(("cache/tmp/", "cache/meta/"))}


def refused(svc: ImageService, tmp_path: Path, ref: str, match: str) -> None:
    """The pull fails with ``match`` and leaves the node as it was."""
    before = everything(tmp_path)
    with pytest.raises(HostileInput, match=match):
        svc.pull(ref, "hostile")
    after = everything(tmp_path)
    assert after == before, f"written: {sorted(after - before)}"
    assert list((tmp_path / "cache/tmp").iterdir()) == []
    assert svc.store.stored() == {}
    assert not OUTSIDE.exists()
    assert not (tmp_path / "local/hostile").exists()


def layout_of(tmp_path: Path, entries: list[Entry], how: str = "gzip") -> str:
    path = write_oci_layout(tmp_path / "layout", build_image([tar_layer(entries)], [how]))
    return f"oci-layout:{path}"


ESCAPES = {
    "dotdot": ([Entry("../../../../../../tmp/aenv-images-escape-test", b"x")], "contains '..'"),
    "absolute": ([Entry(str(OUTSIDE), b"x")], "absolute path"),
    "symlink-dir": ([Entry("up", type=SYM, link="/tmp"),
                     Entry("up/aenv-images-escape-test", b"x")], "through the symlink 'up'"),
    "symlink-relative": ([Entry("a/", type=DIR), Entry("a/up", type=SYM, link="../../../.."),
                          Entry("a/up/tmp/aenv-images-escape-test", b"x")],
                         "through the symlink 'a/up'"),
    "hardlink-out": ([Entry("h", type=LNK, link="../../../../etc/passwd")], "contains '..'"),
    "hardlink-absolute": ([Entry("h", type=LNK, link="/etc/passwd")], "absolute path"),
    "hardlink-via-symlink": ([Entry("etc", type=SYM, link="/etc"),
                              Entry("h", type=LNK, link="etc/passwd")],
                             "through the symlink 'etc'"),
    "whiteout-via-symlink": ([Entry("t", type=SYM, link="/tmp"),
                              Entry("t/.wh.aenv-images-escape-test")],
                             "through the symlink 't'"),
    "opaque-via-symlink": ([Entry("t", type=SYM, link="/tmp"), Entry("t/.wh..wh..opq")],
                           "through the symlink 't'"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_escaping_entries(case: str, svc: ImageService, tmp_path: Path) -> None:
    entries, match = ESCAPES[case]
    refused(svc, tmp_path, layout_of(tmp_path, entries), match)


def test_huge_manifests(svc: ImageService, tmp_path: Path) -> None:
    huge = b'{"schemaVersion": 2, "pad": "' + b"x" * (100 << 20) + b'"}'
    # index.json of a layout
    layout = write_oci_layout(tmp_path / "layout", build_image([tar_layer([Entry("f")])]))
    (layout / "index.json").write_bytes(huge)
    refused(svc, tmp_path, f"oci-layout:{layout}", r"index.json is \d+ bytes; at most")
    # a manifest blob the index points to
    blob = Blob(huge, "application/vnd.oci.image.manifest.v1+json")
    (layout / "blobs/sha256" / blob.digest.split(":")[1]).write_bytes(huge)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        blob.descriptor()]}))
    refused(svc, tmp_path, f"oci-layout:{layout}", "bytes; at most")
    # manifest.json of a docker archive
    archive = tmp_path / "huge.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(huge)
        tar.addfile(info, io.BytesIO(huge))
    refused(svc, tmp_path, f"docker-archive:{archive}", "manifest.json is .* bytes; at most")


class _HugeManifestRegistry(http.server.BaseHTTPRequestHandler):
    """A registry whose manifest never ends (no Content-Length)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        self.end_headers()
        try:
            self.wfile.write(b'{"pad": "')
            for _ in range(100):
                self.wfile.write(b"x" * (1 << 20))
        except OSError:
            pass  # the client hung up, as it should


def test_registry_manifest_too_big(svc: ImageService, tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HugeManifestRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        refused(svc, tmp_path, f"127.0.0.1:{server.server_port}/evil/app:v1",
                "larger than 4194304 bytes; refused")
    finally:
        server.shutdown()
        server.server_close()


def test_digest_mismatch_and_truncation(svc: ImageService, tmp_path: Path) -> None:
    image = build_image([tar_layer([Entry("f", os.urandom(1 << 16))])], ["gzip"])
    layout = write_oci_layout(tmp_path / "layout", image)
    blob = layout / "blobs/sha256" / image.layers[0].digest.split(":")[1]
    good = blob.read_bytes()
    # Same size, different content.
    blob.write_bytes(gzip.compress(tar_layer([Entry("f", os.urandom(1 << 16))]), mtime=0)
                     [:len(good)].ljust(len(good), b"\0"))
    with pytest.raises(HostileInput):
        svc.pull(f"oci-layout:{layout}", "hostile")
    # A valid tar.gz, but not the one the manifest names.
    other = gzip.compress(tar_layer([Entry("g", b"other")]), mtime=0)
    blob.write_bytes(other)
    refused(svc, tmp_path, f"oci-layout:{layout}", "(digest mismatch|descriptor declares)")
    image2 = build_image([tar_layer([Entry("f", b"same size")])], ["gzip"])
    layout2 = write_oci_layout(tmp_path / "layout2", image2)
    blob2 = layout2 / "blobs/sha256" / image2.layers[0].digest.split(":")[1]
    data = bytearray(blob2.read_bytes())
    data[-9] ^= 0xFF  # the gzip trailer's CRC: the stream itself notices
    blob2.write_bytes(bytes(data))
    refused(svc, tmp_path, f"oci-layout:{layout2}", "truncated or corrupt|corrupt or truncated")
    # Truncated: half of the layer.
    blob.write_bytes(good[: len(good) // 2])
    refused(svc, tmp_path, f"oci-layout:{layout}", "truncated")


def test_decompression_bomb_is_bounded(svc: ImageService, tmp_path: Path) -> None:
    bomb = tar_layer([Entry("zeros", bytes(100 << 20))])  # compresses to ~100 KiB
    path = write_oci_layout(tmp_path / "bomb", build_image([bomb], ["zstd"]))
    refused(svc, tmp_path, f"oci-layout:{path}", "unpacks to more than")


def test_docker_archive_layer_not_matching_config(svc: ImageService, tmp_path: Path) -> None:
    archive = write_docker_archive(tmp_path / "a.tar", [tar_layer([Entry("f", b"1")])])
    # Replace the layer with another one: its diff ID no longer matches the config.
    swapped = tmp_path / "b.tar"
    with tarfile.open(archive) as src, tarfile.open(swapped, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name.endswith("layer.tar"):
                data = tar_layer([Entry("f", b"2")])
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    refused(svc, tmp_path, f"docker-archive:{swapped}", "does not match the config's diff ID")


@pytest.mark.parametrize("ref", [
    "evil.example#x/repo", "127.0.0.1:5000?x=/repo", "user@127.0.0.1:5000/repo",
    "a.b\\c/repo", "127.0.0.1:5000/Repo/../x",
])
def test_references_name_one_registry_and_repository(ref: str, svc: ImageService) -> None:
    """A reference's registry becomes the authority of the URLs the node fetches: only a
    host name (and port) is taken, so no reference can smuggle a query, fragment or
    userinfo into them."""
    with pytest.raises(BadReference):
        svc.pull(ref, "hostile")
