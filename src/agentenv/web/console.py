"""The web console (``/ui``) that a node and the gateway both serve: its login, its
session cookie, and its static files (``make ui`` builds them into ``ui/dist``).

The key is sent once, to ``POST /ui/login``; the answer sets an HttpOnly,
SameSite=Strict cookie (Secure under TLS) holding a signed session token, never the
key: ``<expiry>.<HMAC-SHA256 of it under a secret derived from the key>``. A key
rotation therefore ends every session. ``ConsoleSessions`` (ASGI middleware around
the API app, inside the sandbox proxy so nothing of this reaches a sandbox) turns a
valid session into the key for the API's own check, for

- reads (GET, HEAD) from the console's pages,
- state-changing calls only with the header ``X-Aenv-UI: 1`` (a cross-site form or
  link cannot send it: CSRF), and
- WebSockets only when their ``Origin`` is the server's own.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

COOKIE = "aenv_ui"
UI_HEADER = "x-aenv-ui"
SESSION_S = 12 * 3600
MAX_LOGIN_BODY = 4096
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_LABEL = b"agentenv web console session v1"


def ui_dir() -> Path:
    """Where the built console is: ``AENV_UI_DIR``, else ``ui/dist`` of this checkout."""
    env = os.environ.get("AENV_UI_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "ui" / "dist"


def _secret(key: str) -> bytes:
    return hmac.new(key.encode(), _LABEL, hashlib.sha256).digest()


def _sign(expiry: int, key: str) -> str:
    return hmac.new(_secret(key), str(expiry).encode(), hashlib.sha256).hexdigest()


def issue(key: str, now: float | None = None) -> str:
    expiry = int((time.time() if now is None else now) + SESSION_S)
    return f"{expiry}.{_sign(expiry, key)}"


def valid(token: str, keys: list[str], now: float | None = None) -> bool:
    """Whether ``token`` was issued under one of ``keys`` and has not expired."""
    raw_expiry, _, mac = token.partition(".")
    if not raw_expiry.isdigit() or len(raw_expiry) > 12 or len(mac) != 64:
        return False
    expiry = int(raw_expiry)
    if expiry < (time.time() if now is None else now):
        return False
    ok = False
    for key in keys:  # every key compared: timing does not tell which matched
        ok = hmac.compare_digest(_sign(expiry, key), mac) or ok
    return ok


def accepted_keys(app_state: Any) -> list[str]:
    """The keys a session may be signed under: the current one (and one still in its
    rotation grace), from ``app.state.api_keys`` or the fixed ``app.state.api_key``."""
    keys = getattr(app_state, "api_keys", None)
    if keys is not None:
        return keys.accepted()
    return [app_state.api_key]


def _cookie(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                if k == COOKIE:
                    return v
    return None


def without_session(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with the console's cookie taken out of every Cookie header (those
    left empty go): what a sandbox is sent."""
    out = []
    for name, value in headers:
        if name.lower() == b"cookie":
            kept = [p for p in value.split(b";")
                    if p.strip().partition(b"=")[0] != COOKIE.encode()]
            if not any(p.strip() for p in kept):
                continue
            value = b";".join(kept).strip()
        out.append((name, value))
    return out


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value.decode("latin-1")
    return None


def _same_origin(scope: Scope) -> bool:
    origin, host = _header(scope, b"origin"), _header(scope, b"host")
    if not origin or not host:
        return False
    return origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()


class ConsoleSessions:
    """ASGI middleware: a request with no key of its own but a valid console session
    (and, for changes, the console's header; for WebSockets, its own origin) gets the
    current key as ``X-API-Key`` for the routes' usual check."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state  # the API app's state (its keys follow rotations)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self._grant(scope):
            keys = accepted_keys(self.state)
            scope = dict(scope)
            scope["headers"] = [*scope["headers"], (b"x-api-key", keys[0].encode())]
        await self.app(scope, receive, send)

    def _grant(self, scope: Scope) -> bool:
        token = _cookie(scope)
        if not token or _header(scope, b"x-api-key") is not None or \
                _header(scope, b"authorization") is not None:
            return False
        if scope["type"] == "websocket":
            if not _same_origin(scope):
                return False
        elif scope.get("method") not in _SAFE and _header(scope, UI_HEADER.encode()) != "1":
            return False
        return valid(token, accepted_keys(self.state))


def _session(request: Request) -> bool:
    token = request.cookies.get(COOKIE)
    return token is not None and valid(token, accepted_keys(request.app.state))


_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>agentenv console: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;background:#10151c;color:#dde3ea;display:flex;
justify-content:center;margin-top:12vh}}form{{background:#19212b;padding:2em;border-radius:8px;
min-width:22em}}input{{width:100%;box-sizing:border-box;padding:.5em;margin:.6em 0;
background:#0d1117;color:#dde3ea;border:1px solid #3a4656;border-radius:4px}}
button{{padding:.5em 1.2em;background:#2f81f7;color:#fff;border:0;border-radius:4px}}
.err{{color:#ff7b72}}</style></head>
<body><form method="post" action="/ui/login" id="login"><h2>agentenv console</h2>
<label for="key">API key</label><input id="key" name="key" type="password"
autocomplete="current-password" required autofocus>
<p class="err" id="error">{error}</p><button type="submit" id="submit">Log in</button>
</form></body></html>"""


def _login_page(error: str = "", status: int = 200) -> HTMLResponse:
    return HTMLResponse(_LOGIN.format(error=html.escape(error)), status_code=status,
                        headers=_NO_STORE)


_NO_STORE = {"Cache-Control": "no-store", "X-Frame-Options": "DENY",
             "Referrer-Policy": "same-origin"}
# Everything the console loads is its own; the terminal's socket is on this origin.
_CSP = ("default-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'")


def console_router() -> APIRouter:
    """``/ui`` (the console, or the way to log in), ``/ui/login``, ``/ui/logout`` and
    the built assets; everything but the login form needs a session."""
    router = APIRouter(include_in_schema=False)

    @router.get("/ui/login")
    async def login_form() -> Response:
        return _login_page()

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        if "origin" in request.headers and not _same_origin(request.scope):
            return _login_page("Log in from this server's own page.", 403)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return _login_page("The form was too large.", 413)
        try:
            fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:  # more fields than a login form has
            return _login_page("The form was not a login.", 400)
        given = (fields.get("key") or [""])[0].strip()
        keys = accepted_keys(request.app.state)
        ok = False
        for key in keys:
            ok = hmac.compare_digest(given.encode(), key.encode()) or ok
        if not given or not ok:
            return _login_page("That key is not this server's.", 401)
        answer = RedirectResponse("/ui/", status_code=303, headers=_NO_STORE)
        answer.set_cookie(COOKIE, issue(keys[0]), max_age=SESSION_S, path="/",
                          httponly=True, samesite="strict",
                          secure=request.url.scheme == "https")
        return answer

    @router.post("/ui/logout")
    async def logout(request: Request) -> Response:
        if request.headers.get(UI_HEADER) != "1":
            return error_response(403, "the console's header X-Aenv-UI is missing")
        answer = RedirectResponse("/ui/login", status_code=303)
        answer.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return answer

    @router.get("/ui")
    async def bare() -> Response:
        return RedirectResponse("/ui/", status_code=307)

    @router.get("/ui/{path:path}")
    async def asset(path: str, request: Request) -> Response:
        if not _session(request):
            if path in ("", "index.html"):
                return RedirectResponse("/ui/login", status_code=303)
            return error_response(401, "log in at /ui/login first")
        root = ui_dir()
        index = root / "index.html"
        if not index.is_file():
            return error_response(503, f"the web console is not built here ({root}): "
                                       "run `make ui`")
        target = index if path in ("", "index.html") else _inside(root, path)
        if target is None or not target.is_file():
            return error_response(404, f"no such console file: {path[:200]}")
        headers = dict(_NO_STORE) if target == index else {"Cache-Control": "no-cache"}
        headers["Content-Security-Policy"] = _CSP
        headers["X-Content-Type-Options"] = "nosniff"
        return FileResponse(target, headers=headers)

    return router


def _inside(root: Path, path: str) -> Path | None:
    """``path`` below ``root`` (no ``..``, no absolute paths, no symlinks out)."""
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") or "\\" in p or "\x00" in p for p in parts):
        return None
    target = root.joinpath(*parts).resolve()
    base = root.resolve()
    return target if target.is_relative_to(base) else None
