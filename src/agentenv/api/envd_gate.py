"""Who may wake a sandbox through envd's port (issue 29, finding 6).

Traffic to a running sandbox's envd port thaws it if frozen and wakes its envd if
dormant. envd refuses everything but ``/health`` without its access token, so a
request that could only be refused must not cost the wake: the node checks the
credentials first, as envd would, and only then relays. What the node accepts:

- ``X-Access-Token`` equal to the sandbox's envd token (what the e2b SDKs send on
  every envd call of a secure sandbox: ``e2b/sandbox_sync/main.py`` sets it in the
  envd client's headers; the JS SDK the same),
- ``e2b-traffic-access-token`` equal to its traffic token (the key to its ports),
- a ``/files`` URL whose signature the sandbox's token reproduces (the SDKs'
  ``upload_url`` / ``download_url``; envd checks it, and its expiry, again).

``/health`` without any of them is answered here, 204 as envd answers it, without
touching the sandbox; anything else is the 401 envd would give.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qsl

from starlette.types import Scope, Send

from ..envd.protocol import ENVD_PORT, file_signature
from ..orchestrator import SandboxRecord
from ..web import BadTarget, send_error, upstream_url

ENVD_TOKEN_HEADER = b"x-access-token"
TRAFFIC_HEADER = b"e2b-traffic-access-token"
HEALTH_PATH = "/health"
FILES_PATH = "/files"


def _header(scope: Scope, name: bytes) -> bytes:
    return next((v for k, v in scope["headers"] if k.lower() == name), b"")


def _equal(given: bytes, expected: str) -> bool:
    return bool(given) and bool(expected) and hmac.compare_digest(given, expected.encode())


def _signed(scope: Scope, record: SandboxRecord) -> bool:
    if scope["type"] != "http" or scope.get("path") != FILES_PATH:
        return False
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                           keep_blank_values=True))
    signature = query.get("signature")
    if not signature or not record.envd_token:
        return False
    raw_exp = query.get("signature_expiration") or None
    if raw_exp is not None and not raw_exp.isdigit():
        return False
    operation = "read" if scope.get("method") == "GET" else "write"
    expected = file_signature(query.get("path", ""), operation, query.get("username", ""),
                              record.envd_token, int(raw_exp) if raw_exp else None)
    # (an expired one is envd's to refuse: it says so in E2B's words)
    return hmac.compare_digest(signature.encode(), expected.encode())


def may_wake(scope: Scope, record: SandboxRecord) -> bool:
    """Whether the request carries a credential of this sandbox's envd (or ports)."""
    return (_equal(_header(scope, ENVD_TOKEN_HEADER), record.envd_token)
            or _equal(_header(scope, TRAFFIC_HEADER), record.traffic_token)
            or _signed(scope, record))


async def answer_without_waking(scope: Scope, send: Send, record: SandboxRecord) -> None:
    """A bad request-target: the relay's 400; ``/health``: 204 (the sandbox runs);
    anything else: envd's 401."""
    try:
        upstream_url("http", "localhost", ENVD_PORT, scope)  # (only checked)
    except BadTarget as exc:
        await send_error(scope, send, 400, str(exc))
        return
    if scope["type"] == "http" and scope.get("path") == HEALTH_PATH and \
            scope.get("method") in ("GET", "HEAD"):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send_error(scope, send, 401, "invalid or missing access token: send the "
                     "sandbox's envdAccessToken in the X-Access-Token header",
                     record.sandbox_id)
