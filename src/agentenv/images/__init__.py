"""OCI images: pull (registry, OCI layout, docker archive), a content-addressed layer
store within a byte budget, and read-only overlay rootfs mounts of image templates.

The names below are imported on first use: a lazy layer's server
(``python -m agentenv.images.lazyfs``, one process per layer, started on a sandbox's
critical path) imports this package first and needs none of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
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

_WHERE = {
    "BadReference": "errors", "CacheTooSmall": "errors", "HostileInput": "errors",
    "ImageError": "errors", "ImageInUse": "errors", "ImageNotFound": "errors",
    "PullCancelled": "errors", "RegistryAuthError": "errors", "RegistryUnavailable": "errors",
    "LazyLayers": "lazy", "mounted_under": "mounts", "parse_reference": "reference",
    "ImageService": "service", "open_source": "sources", "DEFAULT_MOUNTPOINTS": "store",
    "LayerStore": "store", "unpack_layer": "unpack",
}
__getattr__ = lazy_exports(__name__, _WHERE)

__all__ = [
    "DEFAULT_MOUNTPOINTS", "BadReference", "CacheTooSmall", "HostileInput", "ImageError",
    "ImageInUse", "ImageNotFound", "ImageService", "LayerStore", "LazyLayers", "PullCancelled",
    "RegistryAuthError", "RegistryUnavailable", "mounted_under", "open_source",
    "parse_reference", "unpack_layer",
]
