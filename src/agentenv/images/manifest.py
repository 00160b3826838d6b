"""OCI / Docker v2 schema 2 documents: indexes, manifests, image configs.

Every document is size-capped before it is parsed and checked against its digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .errors import HostileInput, ImageNotFound
from .reference import check_digest

MAX_MANIFEST_BYTES = 4 << 20  # what distribution itself accepts
MAX_CONFIG_BYTES = 8 << 20
MAX_LAYERS = 127  # overlayfs' lower-layer limit with room to spare

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
)
PLATFORM = ("linux", "amd64")
TOC_DIGEST_ANNOTATION = "containerd.io/snapshot/stargz/toc.digest"


@dataclass(frozen=True)
class Layer:
    digest: str  # of the blob as stored (compressed)
    size: int
    media_type: str = ""
    diff_id: str = ""  # of the uncompressed tar, from the config
    # eStargz: the digest of the layer's TOC (its descriptor's annotation), if given.
    toc_digest: str = ""


@dataclass
class Image:
    manifest_digest: str
    layers: list[Layer]
    config: dict = field(default_factory=dict)

    @property
    def run_config(self) -> dict:
        cfg = self.config.get("config") or {}
        return {"env": list(cfg.get("Env") or []), "cmd": list(cfg.get("Cmd") or []),
                "entrypoint": list(cfg.get("Entrypoint") or []),
                "workdir": cfg.get("WorkingDir") or "", "user": cfg.get("User") or ""}


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify(data: bytes, digest: str, what: str) -> None:
    if sha256_of(data) != digest:
        raise HostileInput(f"{what}: content does not match its digest {digest}")


def load_json(data: bytes, what: str, limit: int = MAX_MANIFEST_BYTES) -> dict:
    if len(data) > limit:
        raise HostileInput(f"{what} is {len(data)} bytes; at most {limit} are accepted")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise HostileInput(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise HostileInput(f"{what} is not a JSON object")
    return doc


def media_type_of(doc: dict, header: str = "") -> str:
    kind = doc.get("mediaType") or header.split(";")[0].strip()
    if not kind and "manifests" in doc:
        kind = OCI_INDEX
    if not kind and "layers" in doc:
        kind = OCI_MANIFEST
    return kind


def pick_platform(index: dict, what: str) -> dict:
    """The linux/amd64 entry of an image index."""
    entries = index.get("manifests")
    if not isinstance(entries, list):
        raise HostileInput(f"{what}: index without a manifests list")
    for entry in entries:
        platform = entry.get("platform") or {}
        if (platform.get("os"), platform.get("architecture")) == PLATFORM:
            return entry
    # An index without platforms (an OCI layout's top level) names one image.
    if len(entries) == 1 and not entries[0].get("platform"):
        return entries[0]
    found = sorted({f"{(e.get('platform') or {}).get('os')}/"
                    f"{(e.get('platform') or {}).get('architecture')}" for e in entries})
    raise ImageNotFound(f"{what}: no linux/amd64 image (has {', '.join(found) or 'none'})")


def descriptor(entry: dict, what: str) -> tuple[str, int, str]:
    try:
        digest = check_digest(str(entry["digest"]))
        size = int(entry["size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise HostileInput(f"{what}: malformed descriptor") from exc
    if size < 0:
        raise HostileInput(f"{what}: negative size")
    return digest, size, str(entry.get("mediaType", ""))


def parse_manifest(doc: dict, digest: str, config: dict, what: str) -> Image:
    layers_doc = doc.get("layers")
    if not isinstance(layers_doc, list) or not layers_doc:
        raise HostileInput(f"{what}: manifest without layers")
    if len(layers_doc) > MAX_LAYERS:
        raise HostileInput(f"{what}: {len(layers_doc)} layers; at most {MAX_LAYERS} are supported")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if diff_ids and len(diff_ids) != len(layers_doc):
        raise HostileInput(f"{what}: config lists {len(diff_ids)} layers, manifest "
                           f"{len(layers_doc)}")
    layers = []
    for i, entry in enumerate(layers_doc):
        ldigest, size, kind = descriptor(entry, what)
        if kind and kind not in LAYER_TYPES:
            raise HostileInput(f"{what}: unsupported layer media type {kind[:100]!r}")
        diff_id = check_digest(str(diff_ids[i])) if diff_ids else ""
        annotations = entry.get("annotations") or {}
        toc = annotations.get(TOC_DIGEST_ANNOTATION, "") if isinstance(annotations, dict) else ""
        toc_digest = check_digest(str(toc)) if toc else ""
        layers.append(Layer(ldigest, size, kind, diff_id, toc_digest))
    return Image(digest, layers, config)
