"""What a build step does inside the sandbox, as text: output split into log lines,
Docker's ENV substitution, and the shell that places a COPY's files."""

from __future__ import annotations

import codecs
import collections
import re
import shlex
from collections.abc import Callable

from .store import MAX_MESSAGE, REASON_LOG_LINES

# Marks where an overlong line was cut: the end of a piece continued in the next
# entry, and the start of that next piece.
CONTINUED = "\u2026"
# Longest piece of a line one log entry holds (the markers fit in MAX_MESSAGE).
MAX_LINE = MAX_MESSAGE - 2 * len(CONTINUED)


class LineLog:
    """Command output to log lines, in time linear in the output: each chunk is
    split once and only the partial line's tail (at most ``max_line`` characters)
    is carried to the next chunk. A line longer than ``max_line`` becomes several
    entries, each piece but the last ending in ``CONTINUED`` and each but the
    first starting with it. ``emit`` gets a list of lines per chunk; ``wanted``
    says whether the log still keeps output (once it does not, only the last lines,
    kept for the error of a failed step, are followed). Keeps the last lines."""

    def __init__(self, emit: Callable[[list[str]], None],
                 wanted: Callable[[], bool] = lambda: True, max_line: int = MAX_LINE):
        self.emit = emit
        self.wanted = wanted
        self.max_line = max_line
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}
        self._partial: dict[str, str] = {}  # never longer than max_line
        self._continued: set[str] = set()  # streams whose partial line was cut already
        self._tail: collections.deque[str] = collections.deque(maxlen=REASON_LOG_LINES)

    @property
    def tail(self) -> list[str]:
        return list(self._tail)

    def feed(self, stream: str, data: bytes) -> None:
        decoder = self._decoders.get(stream)
        if decoder is None:
            decoder = self._decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        self._text(stream, decoder.decode(data))

    def flush(self) -> None:
        for stream, decoder in self._decoders.items():
            self._text(stream, decoder.decode(b"", final=True))
        out: list[str] = []
        for stream in list(self._partial):
            rest = self._partial.pop(stream)
            if rest or stream in self._continued:
                self._line(stream, rest, out, complete=True)
        self._continued.clear()
        if out and self.wanted():
            self.emit(out)

    def _text(self, stream: str, text: str) -> None:
        if not text:
            return
        parts = text.split("\n")
        parts[0] = self._partial.pop(stream, "") + parts[0]
        *lines, rest = parts
        out: list[str] = []
        if not self.wanted():
            # Nothing is kept: follow the last lines only (for a failed step's error).
            if lines:
                self._continued.discard(stream)
                for line in lines[-REASON_LOG_LINES:]:
                    self._tail.append(line[:self.max_line].rstrip("\r"))
            self._partial[stream] = rest[-self.max_line:]
            return
        for line in lines:
            self._line(stream, line, out, complete=True)
        self._line(stream, rest, out, complete=False)
        if out:
            self.emit(out)

    def _line(self, stream: str, text: str, out: list[str], complete: bool) -> None:
        """Full pieces of ``text`` to ``out``; the rest too when ``complete``, else
        it is kept as the stream's partial line."""
        if complete:
            text = text.rstrip("\r")
        n, pos = self.max_line, 0
        continued = stream in self._continued
        while len(text) - pos > n:
            out.append((CONTINUED if continued else "") + text[pos:pos + n] + CONTINUED)
            continued, pos = True, pos + n
        rest = text[pos:] if pos else text
        if complete:
            self._continued.discard(stream)
            line = (CONTINUED if continued else "") + rest
            out.append(line)
            self._tail.append(line)
        else:
            self._partial[stream] = rest
            if continued:
                self._continued.add(stream)


_VAR = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's ENV substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alt}, \\$."""
    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        got = env.get(name, "")
        if m.group(2) == "-":
            return got or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if got else ""
        return got

    return _VAR.sub(one, value)


def copy_script(inside: str, gz: bool, src: str, dest: str, owner: str, mode: str) -> str:
    """Shell that unpacks a COPY's archive and places ``src`` at ``dest`` the way
    Docker does: a directory's contents go into dest; a file goes into dest when
    dest ends in '/' or is a directory, else becomes dest."""
    q = shlex.quote
    src = src.removeprefix("./") or "."
    return f"""set -e
t={q(inside)}; rm -rf "$t"; mkdir -p "$t"
tar -x{'z' if gz else ''}f "$t.tar" -C "$t" --no-same-owner; rm -f "$t.tar"
dest={q(dest)}; owner={q(owner)}; mode={q(mode)}
cd "$t"; shopt -s nullglob dotglob
matches=({src if any(c in src for c in '*?[') else q(src)})
[ ${{#matches[@]}} -gt 0 ] || {{ echo "COPY: no files match {src}" >&2; exit 1; }}
placed=()
# A destination directory the COPY creates belongs to the owner too.
made=""
if [ ! -e "$dest" ] && {{ [ -d "${{matches[0]}}" ] || [ "${{dest%/}}" != "$dest" ]; }}; then
  made="$dest"; fi
[[ $owner == *:* ]] || owner="$owner:"  # user alone: their login group too, as Docker
for m in "${{matches[@]}}"; do
  if [ -d "$m" ]; then
    mkdir -p "$dest"; cp -a "$m"/. "$dest"/
    for e in "$m"/*; do placed+=("${{dest%/}}/$(basename "$e")"); done
  elif [ "${{dest%/}}" != "$dest" ] || [ -d "$dest" ] || [ ${{#matches[@]}} -gt 1 ]; then
    mkdir -p "$dest"; cp -a "$m" "$dest"/; placed+=("${{dest%/}}/$(basename "$m")")
  else
    mkdir -p "$(dirname "$dest")"; cp -a "$m" "$dest"; placed+=("$dest")
  fi
done
[ -z "$made" ] || chown "$owner" "$made"
for p in "${{placed[@]}}"; do
  chown -R "$owner" "$p"
  [ -z "$mode" ] || chmod -R "$mode" "$p"
done
cd /; rm -rf "$t"
echo "copied {src} to $dest"
"""
