"""Lazy loading's index of a layer: from the registry's eStargz TOC when the layer is
one (read by range, nothing converted), else by converting the layer once into the
snapshot repository's chunks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .convert import convert_layer
from .estargz import read_layer_toc
from .lazy import LazyLayers
from .manifest import Layer
from .registry_client import RangeUnsupported
from .sources import RegistrySource, Source
from .store import hex_of

log = logging.getLogger("agentenv.images.service")
GZIP_TYPES = ("", "application/vnd.oci.image.layer.v1.tar+gzip",
              "application/vnd.docker.image.rootfs.diff.tar.gzip")


def index_layer(lazy: LazyLayers, source: Source, layer: Layer,
                report: Callable[[int], None], cancel: threading.Event | None) -> None:
    """The layer's index kept for lazy loading (unless another node made it meanwhile)."""
    h = hex_of(layer.digest)
    with lazy.layer_lock(h):
        if lazy.has_index(h):
            return
        if _index_from_registry(lazy, source, layer):
            return
        with source.layer(layer) as chunks:
            index = convert_layer(
                chunks, lazy.repo, h,
                digest_=layer.digest if source.blob_digests else "",
                diff_id=layer.diff_id, declared_size=layer.size,
                what=f"layer {layer.digest[:19]}", progress=report, cancel=cancel)
        lazy.keep_index(h, index)
        log.info("images: layer %s converted for lazy loading (%d files, %d bytes)",
                 h[:12], len(index.entries), index.file_bytes())


def _index_from_registry(lazy: LazyLayers, source: Source, layer: Layer) -> bool:
    """An eStargz layer in a registry: its index from the footer and TOC (read by
    range), kept on this node only; the layer is then served from the registry blob,
    never converted. False for any other layer."""
    if not isinstance(source, RegistrySource) or layer.media_type not in GZIP_TYPES:
        return False
    what = f"layer {layer.digest[:19]}"
    t0 = time.perf_counter()
    try:
        read = read_layer_toc(source.client, layer, what)
    except RangeUnsupported as exc:
        log.info("images: %s: %s; converting it instead", what, exc)
        return False
    if read is None:
        return False
    lazy.keep_index(hex_of(layer.digest), read.index)
    log.info("images: layer %s is eStargz: served from its registry (%d entries; TOC %d "
             "bytes, %d read in %.2f s)", layer.digest[7:19], len(read.index.entries),
             read.toc_bytes, read.fetched, time.perf_counter() - t0)
    return True
