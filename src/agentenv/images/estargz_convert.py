"""Convert an image to eStargz and push it (``aenv image convert --estargz SRC DST``):
each layer read from SRC (a registry, an OCI layout or a docker archive), its blob
digest checked, rewritten by ``estargz_build`` into a local temporary file, pushed to
DST's registry; then the config with the new diff IDs, and a manifest whose layer
descriptors carry the TOC digest annotation.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import zstandard

from .errors import BadReference, HostileInput
from .estargz_build import CHUNK_SIZE, build_estargz
from .manifest import OCI_MANIFEST, TOC_DIGEST_ANNOTATION, sha256_of
from .reference import RegistryRef, parse_reference
from .registry_client import RegistryClient
from .sources import open_source

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


class _Stream(io.RawIOBase):
    """A file over a blob's byte pieces, hashing what passes."""

    def __init__(self, pieces: Iterator[bytes]):
        self.pieces = pieces
        self.hash = hashlib.sha256()
        self.size = 0
        self._left = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._left:
            piece = next(self.pieces, None)
            if piece is None:
                return 0
            self.hash.update(piece)
            self.size += len(piece)
            self._left = piece
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def convert_image(src: str, dst: str, *, username: str = "", password: str = "",
                  dst_username: str | None = None, dst_password: str | None = None,
                  chunk_size: int = CHUNK_SIZE, level: int = 6,
                  say: Callable[[str], None] = lambda _: None) -> str:
    """Push SRC as eStargz to DST; the pushed manifest's digest."""
    target = parse_reference(dst)
    if not isinstance(target, RegistryRef):
        raise BadReference("the destination must be a registry reference")
    source = open_source(src, username, password)
    pusher = RegistryClient(target, username if dst_username is None else dst_username,
                            password if dst_password is None else dst_password)
    try:
        image = source.resolve()
        descriptors, diff_ids = [], []
        with tempfile.TemporaryDirectory(prefix="aenv-estargz-") as tmp:
            for i, layer in enumerate(image.layers):
                out = Path(tmp) / f"layer{i}"
                with source.layer(layer) as pieces:
                    stream = _Stream(pieces)
                    raw = io.BufferedReader(stream, 1 << 20)
                    tar: IO[bytes] = raw
                    if layer.media_type.endswith("zstd"):
                        tar = zstandard.ZstdDecompressor().stream_reader(raw)
                    with open(out, "wb") as f:
                        built = build_estargz(tar, f, chunk_size=chunk_size, level=level)
                    stream.drain()
                if source.blob_digests and "sha256:" + stream.hash.hexdigest() != layer.digest:
                    raise HostileInput(f"layer {layer.digest}: content does not match its digest")
                say(f"layer {i + 1}/{len(image.layers)} {layer.digest[7:19]}: "
                    f"{stream.size} -> {built.size} bytes, TOC {built.toc_digest[7:19]}")
                pusher.push_blob(out, built.digest)
                out.unlink()
                descriptors.append({"mediaType": GZIP_LAYER, "digest": built.digest,
                                    "size": built.size,
                                    "annotations": {TOC_DIGEST_ANNOTATION: built.toc_digest}})
                diff_ids.append(built.diff_id)
            config = dict(image.config)
            config["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
            config_data = json.dumps(config).encode()
            cfg_path = Path(tmp) / "config"
            cfg_path.write_bytes(config_data)
            pusher.push_blob(cfg_path, sha256_of(config_data))
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": sha256_of(config_data),
                       "size": len(config_data)},
            "layers": descriptors}).encode()
        pusher.push_manifest(target.reference, manifest, OCI_MANIFEST)
        return sha256_of(manifest)
    finally:
        source.close()
        pusher.close()
