"""The node's API key: generated once into a 0600 file, compared in constant time,
rotated by ``aenv keys rotate`` (the running node notices the new file)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from fastapi import Header, HTTPException, Request

KEY_FILE = "api-key"


def load_or_create_api_key(secrets_dir: Path) -> str:
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(secrets_dir, 0o700)
    path = secrets_dir / KEY_FILE
    try:
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    except FileNotFoundError:
        pass
    key = "aenv_" + secrets.token_hex(24)
    _write_secret(path, key + "\n")
    return key


def key_matches(given: str | None, expected: str) -> bool:
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def key_id(key: str) -> str:
    """A key's public ID (what per-key quotas are configured by, and what scopes
    idempotency keys): a hash prefix, so config files and logs never hold the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


PREVIOUS_FILE = "api-key.previous"
DEFAULT_GRACE_S = 0


def _write_secret(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text``, owner-only from the first byte."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rotate_api_key(secrets_dir: Path, grace_s: float = DEFAULT_GRACE_S,
                   now: float | None = None) -> str:
    """Give the node a new API key; the running node picks it up on its next request.

    The old key keeps working for ``grace_s`` seconds (0: refused at once), so
    clients can be moved over without downtime. Returns the new key.
    """
    old = load_or_create_api_key(secrets_dir)
    new = "aenv_" + secrets.token_hex(24)
    until = (time.time() if now is None else now) + max(0.0, grace_s)
    prev = secrets_dir / PREVIOUS_FILE
    if grace_s > 0:
        _write_secret(prev, f"{old} {until:.3f}\n")
    else:
        prev.unlink(missing_ok=True)
    _write_secret(secrets_dir / KEY_FILE, new + "\n")
    return new


class ApiKeys:
    """The node's accepted keys, re-read when the key files change (a rotation).

    A ``stat`` per request is the whole cost; comparison is constant-time, and
    both the current and a previous key still in its grace period are always
    compared, so timing does not tell which one matched.
    """

    def __init__(self, secrets_dir: Path):
        self.secrets_dir = secrets_dir
        self._current = load_or_create_api_key(secrets_dir)
        self._previous: tuple[str, float] | None = None
        self._seen: tuple = ()
        self._reload()

    @property
    def current(self) -> str:
        self._reload()
        return self._current

    def _stamp(self) -> tuple:
        out: list[tuple[int, int, int] | None] = []
        for name in (KEY_FILE, PREVIOUS_FILE):
            try:
                st = os.stat(self.secrets_dir / name)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def _reload(self) -> None:
        stamp = self._stamp()
        if stamp == self._seen:
            return
        try:
            key = (self.secrets_dir / KEY_FILE).read_text().strip()
        except FileNotFoundError:
            key = ""
        if key:  # a missing or empty file (mid-edit) keeps the key we had
            self._current = key
        self._previous = None
        try:
            old, _, until = (self.secrets_dir / PREVIOUS_FILE).read_text().strip().partition(" ")
            if old and until:
                self._previous = (old, float(until))
        except (FileNotFoundError, ValueError):
            pass
        self._seen = stamp

    def accepted(self) -> list[str]:
        """The keys accepted now: the current one first, then one in its grace period."""
        self._reload()
        out = [self._current]
        if self._previous is not None and time.time() < self._previous[1]:
            out.append(self._previous[0])
        return out

    def matches(self, given: str | None) -> bool:
        self._reload()
        ok = key_matches(given, self._current)
        if self._previous is not None:
            old_ok = key_matches(given, self._previous[0])
            ok = ok or (old_ok and time.time() < self._previous[1])
        return ok


async def require_api_key(
    request: Request, x_api_key: str | None = Header(default=None, alias="X-API-Key")
) -> None:
    """FastAPI dependency: the request carries the app's key (``app.state.api_keys``, which
    follows rotations, or else the fixed ``app.state.api_key``), as ``X-API-Key`` or, as
    Prometheus and most HTTP tools send credentials, ``Authorization: Bearer``."""
    if x_api_key is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            x_api_key = token.strip()
    keys = getattr(request.app.state, "api_keys", None)
    ok = keys.matches(x_api_key) if keys is not None else key_matches(
        x_api_key, request.app.state.api_key)
    if not ok:
        raise HTTPException(status_code=401, detail="missing or invalid X-API-Key header")
    # Who calls, resolved once here from the key that matched, whichever header carried
    # it: quotas, admission and idempotency all take it from ``caller`` (issue 29).
    request.state.caller = key_id(x_api_key or "")


def caller(request: Request) -> str:
    """The authenticated caller's key ID (set by ``require_api_key``). A route that is
    reached without that check has no caller: that is a bug, not an anonymous owner."""
    who = getattr(request.state, "caller", None)
    if not isinstance(who, str):
        raise RuntimeError(f"{request.url.path}: no authenticated caller (route outside "
                           "require_api_key)")
    return who
