"""A plain gzip layer made lazily servable without converting it: one pass over the
blob, as a pull reads it (digest, diff ID, sizes and names checked as an unpack checks
them), records the decompressor's checkpoints (``gzip_index``) and the tar's file
table; each regular file is cut into chunks of at most ``FILE_CHUNK`` bytes, each named
by the sha256 of its bytes and by its offset in the uncompressed stream. The result is
a ``LayerIndex`` whose chunks are read from the registry blob by range, inflated from
the checkpoint before them and verified against that sha256.
"""

from __future__ import annotations

import hashlib
import tarfile
import threading
from collections.abc import Callable, Iterator

from agentenv.snapshot.gzip_index import SPACING, Recorder
from agentenv.snapshot.layer_index import Entry, LayerIndex, RegistryBlob

from .convert import TreeBuilder
from .errors import HostileInput
from .unpack import read_layer

FILE_CHUNK = 4 << 20


def index_gzip_layer(chunks: Iterator[bytes], blob: RegistryBlob, *, diff_id: str = "",
                     spacing: int = SPACING, max_bytes: int = 1 << 40,
                     what: str = "layer", progress: Callable[[int], None] | None = None,
                     cancel: threading.Event | None = None) -> LayerIndex:
    """The layer's index, its chunks ranges of ``blob`` (read in full, once, here)."""
    builder = TreeBuilder(what)
    rec = Recorder(spacing)

    def add(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        builder.add(member, lambda entry: _hash(tar, member, entry))

    got, tar_digest = read_layer(chunks, add, digest=blob.digest, diff_id=diff_id,
                                 declared_size=blob.size, max_bytes=max_bytes, what=what,
                                 progress=progress, cancel=cancel, gzip=rec.inflater)
    if not rec.points:
        raise HostileInput(f"{what}: not a gzip layer")
    return LayerIndex(got, tar_digest, builder.entries, blob, rec.result(blob.size))


def _hash(tar: tarfile.TarFile, member: tarfile.TarInfo, entry: Entry) -> None:
    data = tar.extractfile(member)
    if data is None or not member.size:
        return
    at = member.offset_data
    while True:
        piece = data.read(FILE_CHUNK)
        if not piece:
            break
        entry.chunks.append((hashlib.sha256(piece).hexdigest(), len(piece)))
        entry.spans.append((at, len(piece), 0))
        at += len(piece)
