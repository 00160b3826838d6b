"""Where an image comes from: a registry, an OCI image-layout directory, a docker-archive tar.

Each source resolves to an ``Image`` (the linux/amd64 manifest, its config and
layers) and streams a layer's blob by digest, so evicted layers can be fetched
again from the same source later.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from .errors import BadReference, HostileInput, ImageNotFound
from .manifest import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    Image,
    Layer,
    descriptor,
    load_json,
    media_type_of,
    parse_manifest,
    pick_platform,
    sha256_of,
    verify,
)
from .reference import ArchiveRef, ImageRef, LayoutRef, RegistryRef, parse_reference
from .registry_client import RegistryClient

CHUNK = 1 << 20
REF_NAME = "org.opencontainers.image.ref.name"


class Source(Protocol):
    # False when a layer's digest is that of its uncompressed tar (docker-archive):
    # then the tar bytes are checked against it instead of the blob bytes.
    blob_digests: bool

    def resolve(self) -> Image: ...

    def layer(self, layer: Layer) -> contextlib.AbstractContextManager[Iterator[bytes]]: ...

    def close(self) -> None: ...


def open_source(text: str, username: str = "", password: str = "") -> Source:
    ref: ImageRef = parse_reference(text)
    if isinstance(ref, RegistryRef):
        return RegistrySource(ref, username, password)
    if isinstance(ref, LayoutRef):
        return LayoutSource(ref)
    return ArchiveSource(ref)


class RegistrySource:
    blob_digests = True

    def __init__(self, ref: RegistryRef, username: str = "", password: str = ""):
        self.ref = ref
        self.client = RegistryClient(ref, username, password)

    def resolve(self) -> Image:
        data, ctype = self.client.manifest(self.ref.reference)
        digest = sha256_of(data)
        if self.ref.digest:
            verify(data, self.ref.digest, f"manifest {self.ref.digest}")
        doc = load_json(data, f"manifest of {self.ref}")
        if media_type_of(doc, ctype) in INDEX_TYPES:
            digest, _, _ = descriptor(pick_platform(doc, str(self.ref)), str(self.ref))
            data, ctype = self.client.manifest(digest)
            verify(data, digest, f"manifest {digest}")
            doc = load_json(data, f"manifest {digest}")
        kind = media_type_of(doc, ctype)
        if kind not in MANIFEST_TYPES:
            # (not echoed: the type may be what another host answered, after a redirect)
            raise HostileInput(f"{self.ref}: not an image manifest this node reads (an OCI "
                               "or Docker v2 manifest, or an index of them)")
        cfg_digest, cfg_size, _ = descriptor(doc.get("config") or {}, f"config of {self.ref}")
        if cfg_size > MAX_CONFIG_BYTES:
            raise HostileInput(f"{self.ref}: image config of {cfg_size} bytes refused")
        cfg_data = self.client.blob_bytes(cfg_digest, MAX_CONFIG_BYTES)
        verify(cfg_data, cfg_digest, f"config {cfg_digest}")
        config = load_json(cfg_data, "image config", MAX_CONFIG_BYTES)
        return parse_manifest(doc, digest, config, str(self.ref))

    def layer(self, layer: Layer) -> contextlib.AbstractContextManager[Iterator[bytes]]:
        return self.client.blob(layer.digest)

    def close(self) -> None:
        self.client.close()


def _read_file(path: Path, limit: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise HostileInput(f"{what} is {size} bytes; at most {limit} are accepted")
            return f.read(limit + 1)
    except FileNotFoundError as exc:
        raise ImageNotFound(f"{what} not found ({path})") from exc
    except IsADirectoryError as exc:
        raise HostileInput(f"{what} is a directory ({path})") from exc


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


class LayoutSource:
    """An OCI image layout: ``oci-layout``, ``index.json``, ``blobs/sha256/*``."""

    blob_digests = True

    def __init__(self, ref: LayoutRef):
        self.ref = ref
        if not (ref.path / "oci-layout").is_file():
            raise ImageNotFound(f"{ref.path} is not an OCI image layout (no oci-layout file)")

    def _blob_path(self, digest: str) -> Path:
        return self.ref.path / "blobs" / "sha256" / digest.split(":", 1)[1]

    def _doc(self, digest: str, limit: int, what: str) -> dict:
        data = _read_file(self._blob_path(digest), limit, what)
        verify(data, digest, what)
        return load_json(data, what, limit)

    def resolve(self) -> Image:
        what = str(self.ref)
        index = load_json(_read_file(self.ref.path / "index.json", MAX_MANIFEST_BYTES,
                                     f"{what} index.json"), f"{what} index.json")
        entries = index.get("manifests")
        if not isinstance(entries, list) or not entries:
            raise ImageNotFound(f"{what}: index.json lists no images")
        if self.ref.tag:
            named = [e for e in entries if isinstance(e, dict) and
                     (e.get("annotations") or {}).get(REF_NAME, "").rsplit(":", 1)[-1]
                     == self.ref.tag]
            if not named:
                raise ImageNotFound(f"{what}: no image tagged {self.ref.tag!r}")
            entry = named[0]
        else:
            entry = entries[0] if len(entries) == 1 else pick_platform(index, what)
        digest, _, kind = descriptor(entry, what)
        doc = self._doc(digest, MAX_MANIFEST_BYTES, f"{what} manifest {digest}")
        if (kind or media_type_of(doc)) in INDEX_TYPES:
            digest, _, _ = descriptor(pick_platform(doc, what), what)
            doc = self._doc(digest, MAX_MANIFEST_BYTES, f"{what} manifest {digest}")
        if media_type_of(doc) not in MANIFEST_TYPES:
            raise HostileInput(f"{what}: {digest} is not an image manifest")
        cfg_digest, _, _ = descriptor(doc.get("config") or {}, f"config of {what}")
        config = self._doc(cfg_digest, MAX_CONFIG_BYTES, f"{what} config")
        return parse_manifest(doc, digest, config, what)

    @contextlib.contextmanager
    def layer(self, layer: Layer) -> Iterator[Iterator[bytes]]:
        path = self._blob_path(layer.digest)
        if not path.is_file():
            raise ImageNotFound(f"{self.ref}: layer blob {layer.digest} is missing")
        yield _chunks(path)

    def close(self) -> None:
        pass


class ArchiveSource:
    """``docker save`` output: ``manifest.json`` naming the config and layer tars."""

    blob_digests = False

    def __init__(self, ref: ArchiveRef):
        self.ref = ref
        try:
            self.tar = tarfile.open(ref.path, "r:*")
        except FileNotFoundError as exc:
            raise ImageNotFound(f"{ref.path} not found") from exc
        except (tarfile.TarError, OSError) as exc:
            raise BadReference(f"{ref.path} is not a readable tar archive: {exc}") from exc
        self._paths: dict[str, str] = {}
        # Layers are fetched by several threads at once, and every member's reader
        # seeks the archive's one file object before it reads: each seek-and-read is
        # done under this lock, or a thread reads at another's offset (seen: "corrupt or
        # truncated layer" for a docker-archive pull under load).
        self._read_lock = threading.Lock()

    def _member_bytes(self, name: str, limit: int, what: str) -> bytes:
        try:
            member = self.tar.getmember(name)
        except KeyError as exc:
            raise ImageNotFound(f"{self.ref}: {what} ({name[:200]}) is missing") from exc
        if not member.isreg():
            raise HostileInput(f"{self.ref}: {what} is not a regular file")
        if member.size > limit:
            raise HostileInput(f"{self.ref}: {what} is {member.size} bytes; at most {limit} "
                               "are accepted")
        with self._read_lock:
            f = self.tar.extractfile(member)
            assert f is not None
            return f.read()

    def resolve(self) -> Image:
        what = str(self.ref)
        raw = self._member_bytes("manifest.json", MAX_MANIFEST_BYTES, "manifest.json")
        try:
            entries = json.loads(raw)
            entry = entries[0]
            config_name, layer_names = str(entry["Config"]), [str(x) for x in entry["Layers"]]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise HostileInput(f"{what}: malformed manifest.json") from exc
        cfg_data = self._member_bytes(config_name, MAX_CONFIG_BYTES, "image config")
        config = load_json(cfg_data, f"{what} config", MAX_CONFIG_BYTES)
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layer_names):
            raise HostileInput(f"{what}: config lists {len(diff_ids)} layers, manifest.json "
                               f"{len(layer_names)}")
        layers = []
        for name, diff_id in zip(layer_names, diff_ids, strict=True):
            try:
                size = self.tar.getmember(name).size
            except KeyError as exc:
                raise ImageNotFound(f"{what}: layer {name[:200]} is missing") from exc
            digest, _, _ = descriptor({"digest": diff_id, "size": size}, what)
            self._paths[digest] = name
            layers.append(Layer(digest, size, "", digest))
        # The config's digest is the image ID docker shows.
        image = Image(sha256_of(cfg_data), layers, config)
        parse_manifest({"layers": [{"digest": x.digest, "size": x.size} for x in layers]},
                       image.manifest_digest, config, what)  # the same checks as elsewhere
        return image

    @contextlib.contextmanager
    def layer(self, layer: Layer) -> Iterator[Iterator[bytes]]:
        if layer.digest not in self._paths:
            self.resolve()
        with self._read_lock:
            f = self.tar.extractfile(self._paths[layer.digest])
        if f is None:
            raise HostileInput(f"{self.ref}: layer {layer.digest} is not a file")

        def chunks() -> Iterator[bytes]:
            while True:
                with self._read_lock:
                    chunk = f.read(CHUNK)
                if not chunk:
                    return
                yield chunk
        yield chunks()

    def close(self) -> None:
        self.tar.close()
