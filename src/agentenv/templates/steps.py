"""What a build step does inside the sandbox, as text: output split into log lines,
Docker's ENV substitution, and the shell that places a COPY's files."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable

from .builds import REASON_LOG_LINES


class LineLog:
    """Command output to one log entry per line; keeps the last lines for errors."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit = emit
        self.partial: dict[str, str] = {}
        self.tail: list[str] = []

    def feed(self, stream: str, data: bytes) -> None:
        text = self.partial.get(stream, "") + data.decode(errors="replace")
        *lines, self.partial[stream] = text.split("\n")
        for line in lines:
            self._line(line)

    def flush(self) -> None:
        for rest in self.partial.values():
            if rest:
                self._line(rest)
        self.partial.clear()

    def _line(self, line: str) -> None:
        line = line.rstrip("\r")
        self.emit(line)
        self.tail = [*self.tail[-(REASON_LOG_LINES - 1):], line]


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
