"""Lazy loading's index of a layer: from the shared repository when a node made it
already; else from the registry's eStargz TOC when the layer is one (read by range,
nothing converted); else, for a plain gzip layer in a registry that serves ranges, by
reading it once to record its decompressor's checkpoints and file table (stored in the
repository for every other node; the layer is then served from the registry blob);
else by converting the layer once into the snapshot repository's chunks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agentenv.snapshot.layer_index import RegistryBlob

from .convert import convert_layer
from .estargz import read_layer_toc
from .gzip_layer import index_gzip_layer
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
        if isinstance(source, RegistrySource) and layer.media_type in GZIP_TYPES and \
                lazy.gzip_checkpoints:
            _index_gzip(lazy, source, layer, report, cancel)
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
        return False  # a plain gzip layer (its range was served: checkpoints may be read)
    lazy.keep_index(hex_of(layer.digest), read.index)
    log.info("images: layer %s is eStargz: served from its registry (%d entries; TOC %d "
             "bytes, %d read in %.2f s)", layer.digest[7:19], len(read.index.entries),
             read.toc_bytes, read.fetched, time.perf_counter() - t0)
    return True


def _index_gzip(lazy: LazyLayers, source: RegistrySource, layer: Layer,
                report: Callable[[int], None], cancel: threading.Event | None) -> None:
    """A plain gzip layer: read once (as a pull reads it, and checked as one) to record
    its checkpoints and file table; the index goes to the repository, for every node."""
    what = f"layer {layer.digest[:19]}"
    t0 = time.perf_counter()
    blob = RegistryBlob(source.client.ref.registry, source.client.ref.repository,
                        layer.digest, layer.size, layer.size)
    with source.layer(layer) as chunks:
        index = index_gzip_layer(chunks, blob, diff_id=layer.diff_id, what=what,
                                 progress=report, cancel=cancel)
    lazy.keep_index(hex_of(layer.digest), index, share=True)
    assert index.gzip is not None
    log.info("images: layer %s indexed for lazy loading from its registry (%d files, %d "
             "checkpoints, %d bytes of tar) in %.2f s", layer.digest[7:19],
             len(index.entries), len(index.gzip.points), index.gzip.tar_size,
             time.perf_counter() - t0)
