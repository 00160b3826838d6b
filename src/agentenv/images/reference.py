"""Image references: ``[registry/]repo[:tag][@digest]``, ``oci-layout:DIR[:tag]``,
``docker-archive:FILE``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import BadReference, ImageError

DOCKER_HUB = "registry-1.docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")
# A registry is a host name or IPv4 address with an optional port, nothing else: it
# becomes the authority of the URLs the node fetches.
_REGISTRY = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class RegistryRef:
    registry: str  # host[:port]
    repository: str
    tag: str = "latest"
    digest: str = ""

    @property
    def reference(self) -> str:
        """What goes in /v2/<repo>/manifests/<reference>."""
        return self.digest or self.tag

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        return out + (f"@{self.digest}" if self.digest else "")


@dataclass(frozen=True)
class LayoutRef:
    path: Path
    tag: str = ""

    def __str__(self) -> str:
        return f"oci-layout:{self.path}" + (f":{self.tag}" if self.tag else "")


@dataclass(frozen=True)
class ArchiveRef:
    path: Path

    def __str__(self) -> str:
        return f"docker-archive:{self.path}"


ImageRef = RegistryRef | LayoutRef | ArchiveRef


# As Docker's reference grammar: a name (registry and repository) of at most 255.
NAME_MAX = 255

def check_digest(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise BadReference(f"unsupported digest {digest[:80]!r} (only sha256 is accepted)")
    return digest


def parse_reference(text: str) -> ImageRef:
    text = text.strip()
    if not text or len(text) > 1024:
        raise BadReference("image reference is empty or too long")
    if text.startswith("oci-layout:"):
        rest = text[len("oci-layout:"):]
        path, _, tag = rest.rpartition(":") if ":" in rest else (rest, "", "")
        if not path.startswith("/"):
            raise BadReference("oci-layout needs an absolute directory path")
        if tag and not _TAG.match(tag):
            raise BadReference(f"bad tag {tag!r}")
        return LayoutRef(Path(path), tag)
    if text.startswith("docker-archive:"):
        path = text[len("docker-archive:"):]
        if not path.startswith("/"):
            raise BadReference("docker-archive needs an absolute file path")
        return ArchiveRef(Path(path))
    name, digest = text, ""
    if "@" in name:
        name, digest = name.split("@", 1)
        check_digest(digest)
    if len(name) > NAME_MAX:
        raise BadReference(f"image name over {NAME_MAX} characters: {name[:80]!r}...")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
        if not _TAG.match(tag):
            raise BadReference(f"bad tag {tag!r}")
    first, _, remainder = name.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry, repo = first, remainder
        if len(registry) > 255 or not _REGISTRY.match(registry):
            raise BadReference(f"bad registry {registry[:80]!r}: a host name and an optional "
                               "port")
    else:
        registry, repo = DOCKER_HUB, name if "/" in name else f"library/{name}"
    if not _REPO.match(repo):
        raise BadReference(f"bad repository name {repo!r} in {text!r}")
    return RegistryRef(registry, repo, tag or ("" if digest else "latest"), digest)


def registry_origin(source: str) -> tuple[str, str] | None:
    """The registry and repository of an image's source, when it is a registry."""
    try:
        ref = parse_reference(source)
    except ImageError:
        return None
    return (ref.registry, ref.repository) if isinstance(ref, RegistryRef) else None
