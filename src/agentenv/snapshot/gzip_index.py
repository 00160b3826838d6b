"""A seekable index of a plain gzip layer (the approach of AWS's SOCI snapshotter):
checkpoints of the decompressor every few MiB of output, recorded in the one pass that
reads the layer, so that any part of the blob can later be inflated from the nearest
checkpoint before it, fetched by HTTP range from the registry.

A checkpoint is where a deflate block begins: its bit position in the blob, its offset
in the uncompressed tar stream, and the (up to) 32 KiB of output before it, the window
back-references may reach into. The start of every gzip member is a checkpoint too
(byte-aligned, no window). The bytes between two consecutive checkpoints are a *span*:
the unit fetched and inflated.

Both directions call the system's zlib through ctypes: Python's ``zlib`` neither says
where blocks end nor lets an inflate start inside a byte. Building, ``inflate`` with
``Z_BLOCK`` stops at each block boundary and reports the unused bits of the last byte
read. Serving, a raw inflate is primed with the high bits of the checkpoint's first
byte (``inflatePrime``: a stored block's padding depends on the blob's own byte
boundaries, so the bytes cannot simply be shifted) and given the window as its
dictionary.
Nothing here trusts an index: ``GzipPoints.check`` bounds it against the blob, and every
span's output must have exactly the length its checkpoints say.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import ctypes.util
import zlib
from collections import deque
from dataclasses import dataclass, field

WINDOW = 32 << 10
SPACING = 4 << 20  # uncompressed bytes between checkpoints (SOCI's default span size)
MIN_SPACING = 64 << 10
MAX_SPAN_OUT = 64 << 20  # a span's output: a deflate block is far smaller in practice
MAX_POINTS = 1 << 20
_OUT = 1 << 20  # inflate's output buffer

Z_NO_FLUSH, Z_OK, Z_STREAM_END, Z_BUF_ERROR, Z_BLOCK = 0, 0, 1, -5, 5


class BadGzipIndex(ValueError):
    """Checkpoints that do not fit the blob they claim to index."""


@dataclass
class Point:
    bit: int  # bit position of the block (or member, when ``member``) in the blob
    out: int  # offset in the uncompressed stream
    member: bool  # a gzip member starts here (the header, byte-aligned, no window)
    window: bytes = b""


@dataclass
class GzipPoints:
    """A gzip blob's checkpoints, sorted by ``out`` (strictly increasing, the first at 0),
    with the blob's compressed and uncompressed sizes."""

    size: int  # bytes of the blob
    tar_size: int  # bytes of its output
    spacing: int
    points: list[Point] = field(default_factory=list)
    _outs: list[int] = field(default_factory=list, repr=False, compare=False)

    def to_doc(self) -> dict:
        return {"size": self.size, "tarSize": self.tar_size, "spacing": self.spacing,
                "points": [[p.bit, p.out, int(p.member), base64.b64encode(p.window).decode()]
                           for p in self.points]}

    @classmethod
    def from_doc(cls, doc: object) -> GzipPoints:
        if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
            raise BadGzipIndex("malformed gzip checkpoints")
        if len(doc["points"]) > MAX_POINTS:
            raise BadGzipIndex(f"{len(doc['points'])} gzip checkpoints; at most {MAX_POINTS}")
        try:
            g = cls(int(doc["size"]), int(doc["tarSize"]), int(doc["spacing"]),
                    [Point(int(b), int(o), bool(m), base64.b64decode(str(w), validate=True))
                     for b, o, m, w in doc["points"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise BadGzipIndex(f"malformed gzip checkpoints ({exc})") from exc
        g.check()
        return g

    def check(self) -> None:
        """Every checkpoint inside the blob and its output, in order, spans bounded."""
        if not (0 < self.size <= 1 << 42 and 0 <= self.tar_size <= 1 << 44 and
                MIN_SPACING <= self.spacing <= MAX_SPAN_OUT) or not self.points:
            raise BadGzipIndex(f"gzip checkpoints of a {self.size}-byte blob with "
                               f"{self.tar_size} bytes of output and spacing {self.spacing}")
        first = self.points[0]
        if first.bit != 0 or first.out != 0 or not first.member:
            raise BadGzipIndex("the first gzip checkpoint is not the blob's start")
        for i, p in enumerate(self.points):
            end = self.points[i + 1].out if i + 1 < len(self.points) else self.tar_size
            if not 0 <= p.bit < self.size * 8 or not 0 <= p.out < max(self.tar_size, 1) or \
                    len(p.window) > WINDOW or (p.member and (p.bit % 8 or p.window)):
                raise BadGzipIndex(f"gzip checkpoint {i} (bit {p.bit}, output {p.out}) lies "
                                   f"outside the {self.size}-byte blob or its output: the "
                                   "index points outside the blob")
            if i and (p.bit <= self.points[i - 1].bit or not 0 < end - p.out <= MAX_SPAN_OUT):
                raise BadGzipIndex(f"gzip checkpoint {i} is out of order or its span is "
                                   "empty or too long")
            if i + 1 == len(self.points) and not 0 <= end - p.out <= MAX_SPAN_OUT:
                raise BadGzipIndex("the last gzip span is too long")

    def span_of(self, out: int) -> int:
        """The index of the span holding uncompressed offset ``out``."""
        if len(self._outs) != len(self.points):
            self._outs = [p.out for p in self.points]
        return max(0, bisect.bisect_right(self._outs, out) - 1)

    def span_range(self, k: int) -> tuple[int, int, int, int]:
        """Span k: (first byte to fetch, bytes to fetch, output offset, output bytes)."""
        p = self.points[k]
        start = p.bit // 8
        if k + 1 < len(self.points):
            nxt = self.points[k + 1]
            end, out_end = (nxt.bit + 7) // 8, nxt.out
        else:
            end, out_end = self.size, self.tar_size
        return start, max(end - start, 1), p.out, out_end - p.out


def inflate_span(g: GzipPoints, k: int, raw: bytes) -> bytes:
    """Span k's output from its fetched bytes (``span_range``); raises BadGzipIndex when
    they do not inflate to exactly the span's length."""
    p = g.points[k]
    _, _, _, want = g.span_range(k)
    lib = _lib()
    z = _ZStream()
    if lib.inflateInit2_(ctypes.byref(z), 31 if p.member else -15, lib.zlibVersion(),
                         ctypes.sizeof(_ZStream)) != Z_OK:
        raise MemoryError("zlib inflateInit2 failed")
    try:
        shift = p.bit % 8
        if shift and raw:  # the block starts inside the first byte: its high bits first
            lib.inflatePrime(ctypes.byref(z), 8 - shift, raw[0] >> shift)
            raw = raw[1:]
        if p.window and lib.inflateSetDictionary(ctypes.byref(z), p.window,
                                                 len(p.window)) != Z_OK:
            raise BadGzipIndex(f"gzip checkpoint {k}: its window is refused")
        inbuf = ctypes.create_string_buffer(raw, len(raw))
        out = ctypes.create_string_buffer(max(want, 1))
        z.next_in, z.avail_in = ctypes.addressof(inbuf), len(raw)
        z.next_out, z.avail_out = ctypes.addressof(out), want
        ret = Z_OK
        while z.avail_out and ret == Z_OK:
            ret = lib.inflate(ctypes.byref(z), 0)
        got = want - z.avail_out
        if ret not in (Z_OK, Z_STREAM_END, Z_BUF_ERROR):
            msg = z.msg.decode(errors="replace") if z.msg else f"error {ret}"
            raise BadGzipIndex(f"gzip span {k} (bit {p.bit} of the blob) does not inflate: "
                               f"{msg}")
        if got != want:
            raise BadGzipIndex(f"gzip span {k} (bit {p.bit} of the blob) inflates to {got} "
                               f"bytes; its checkpoints say {want}")
        return out.raw[:want]
    finally:
        lib.inflateEnd(ctypes.byref(z))


# -- building: zlib's inflate through ctypes ------------------------------------------


class _ZStream(ctypes.Structure):
    _fields_ = [("next_in", ctypes.c_void_p), ("avail_in", ctypes.c_uint),
                ("total_in", ctypes.c_ulong), ("next_out", ctypes.c_void_p),
                ("avail_out", ctypes.c_uint), ("total_out", ctypes.c_ulong),
                ("msg", ctypes.c_char_p), ("state", ctypes.c_void_p),
                ("zalloc", ctypes.c_void_p), ("zfree", ctypes.c_void_p),
                ("opaque", ctypes.c_void_p), ("data_type", ctypes.c_int),
                ("adler", ctypes.c_ulong), ("reserved", ctypes.c_ulong)]


_libz: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libz
    if _libz is None:
        lib = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        lib.zlibVersion.restype = ctypes.c_char_p
        lib.inflateInit2_.argtypes = [ctypes.POINTER(_ZStream), ctypes.c_int,
                                      ctypes.c_char_p, ctypes.c_int]
        lib.inflate.argtypes = [ctypes.POINTER(_ZStream), ctypes.c_int]
        lib.inflateEnd.argtypes = [ctypes.POINTER(_ZStream)]
        lib.inflatePrime.argtypes = [ctypes.POINTER(_ZStream), ctypes.c_int, ctypes.c_int]
        lib.inflateSetDictionary.argtypes = [ctypes.POINTER(_ZStream), ctypes.c_char_p,
                                             ctypes.c_uint]
        _libz = lib
    return _libz


class Recorder:
    """The checkpoints of one blob, filled by the ``Inflater`` of each of its members."""

    def __init__(self, spacing: int = SPACING):
        if not MIN_SPACING <= spacing <= MAX_SPAN_OUT // 2:
            raise ValueError(f"checkpoint spacing {spacing}")
        self.spacing = spacing
        self.points: list[Point] = []
        self.in_pos = 0  # compressed bytes consumed by finished members
        self.out_pos = 0

    def inflater(self) -> Inflater:
        """A decompressor for the member starting where the last one ended (the
        interface of ``zlib.decompressobj(wbits=31)`` that ``unpack._Tar`` uses)."""
        return Inflater(self)

    def result(self, size: int) -> GzipPoints:
        while len(self.points) > 1 and self.points[-1].out >= self.out_pos:
            self.points.pop()
        g = GzipPoints(size, self.out_pos, self.spacing, self.points)
        g.check()
        return g


class Inflater:
    def __init__(self, rec: Recorder):
        self._rec = rec
        self._lib = _lib()
        self._z = _ZStream()
        if self._lib.inflateInit2_(ctypes.byref(self._z), 31, self._lib.zlibVersion(),
                                   ctypes.sizeof(_ZStream)) != Z_OK:
            raise MemoryError("zlib inflateInit2 failed")
        self._out = ctypes.create_string_buffer(_OUT)
        self._recent: deque[bytes] = deque()  # the last WINDOW bytes of output, or more
        self._recent_bytes = 0
        self._base_in, self._base_out = rec.in_pos, rec.out_pos
        self._last = rec.out_pos
        self.eof = False
        self.unused_data = b""
        self.unconsumed_tail = b""
        self._open = True
        # A member's start is a checkpoint: byte-aligned, nothing before it to refer to.
        # A point with no output after it (an empty member, or before an empty last
        # block) starts no span.
        if rec.points and rec.points[-1].out == self._base_out:
            rec.points.pop()
        rec.points.append(Point(self._base_in * 8, self._base_out, True))

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        if self.eof:
            self.unused_data += data
            return b""
        z, lib, rec = self._z, self._lib, self._rec
        inbuf = ctypes.create_string_buffer(bytes(data), len(data))
        z.next_in = ctypes.addressof(inbuf)
        z.avail_in = len(data)
        pieces: list[bytes] = []
        produced = 0
        limit = max_length or (1 << 62)
        full = False  # the output buffer filled: inflate may hold more without input
        while produced < limit and (z.avail_in or full):
            # Block by block only once a checkpoint is due (each return takes the GIL
            # back, and blocks are small: 64 KiB of output or less for stored data);
            # until then in large steps that stop where it falls due.
            ahead = rec.spacing - (self._base_out + z.total_out - self._last)
            due = ahead <= 0
            room = min(_OUT, limit - produced) if due else min(_OUT, limit - produced, ahead)
            z.next_out = ctypes.addressof(self._out)
            z.avail_out = room
            ret = lib.inflate(ctypes.byref(z), Z_BLOCK if due else Z_NO_FLUSH)
            n = room - z.avail_out
            if n:
                piece = ctypes.string_at(self._out, n)
                pieces.append(piece)
                produced += n
                self._keep(piece)
            full = n == room
            if ret == Z_STREAM_END:
                self.eof = True
                break
            if ret not in (Z_OK, Z_BUF_ERROR):
                msg = z.msg.decode(errors="replace") if z.msg else f"error {ret}"
                self._end()
                raise zlib.error(f"Error {ret} while decompressing data: {msg}")
            if ret == Z_BUF_ERROR and not n:
                break
            # At a block's end (bit 7), not after the last one (bit 6): a checkpoint.
            if due and z.data_type & 128 and not z.data_type & 64:
                out = self._base_out + z.total_out
                if out - self._last >= rec.spacing:
                    bit = (self._base_in + z.total_in) * 8 - (z.data_type & 7)
                    rec.points.append(Point(bit, out, False, self._window()))
                    self._last = out
        rest = z.avail_in
        if self.eof:
            consumed = z.total_in
            rec.in_pos = self._base_in + consumed
            rec.out_pos = self._base_out + z.total_out
            self.unused_data = bytes(data[len(data) - rest:]) if rest else b""
            self.unconsumed_tail = b""
            self._end()
        else:
            self.unconsumed_tail = bytes(data[len(data) - rest:]) if rest else b""
        return b"".join(pieces)

    def _keep(self, piece: bytes) -> None:
        self._recent.append(piece)
        self._recent_bytes += len(piece)
        while self._recent_bytes - len(self._recent[0]) >= WINDOW:
            self._recent_bytes -= len(self._recent.popleft())

    def _window(self) -> bytes:
        return b"".join(self._recent)[-WINDOW:]

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._lib.inflateEnd(ctypes.byref(self._z))

    def __del__(self) -> None:
        try:
            self._end()
        except Exception:
            pass
