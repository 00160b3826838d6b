"""OCI images: pull (registry, OCI layout, docker archive), a content-addressed layer
store within a byte budget, and read-only overlay rootfs mounts of image templates."""

from .errors import (
    BadReference,
    CacheTooSmall,
    HostileInput,
    ImageError,
    ImageInUse,
    ImageNotFound,
    PullCancelled,
    RegistryAuthError,
    RegistryUnavailable,
)
from .lazy import LazyLayers
from .mounts import mounted_under
from .reference import parse_reference
from .service import ImageService
from .sources import open_source
from .store import DEFAULT_MOUNTPOINTS, LayerStore
from .unpack import unpack_layer

__all__ = [
    "DEFAULT_MOUNTPOINTS", "BadReference", "CacheTooSmall", "HostileInput", "ImageError",
    "ImageInUse", "ImageNotFound", "ImageService", "LayerStore", "LazyLayers", "PullCancelled",
    "RegistryAuthError", "RegistryUnavailable", "mounted_under", "open_source",
    "parse_reference", "unpack_layer",
]
