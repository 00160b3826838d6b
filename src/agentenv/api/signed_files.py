"""Routes signed file URLs that name no sandbox to the sandbox that signed them.

With ``E2B_SANDBOX_URL`` set, the SDKs' ``upload_url()`` / ``download_url()``
are ``<node>/files?path=...&signature=...``: the sandbox is named by neither a
header nor the Host, only by the signature, which is keyed by that sandbox's
envd access token. The node knows every token, so it finds the one sandbox whose
token reproduces the signature and hands the request to the proxy for that
sandbox's envd (which checks the signature, and its expiry, again).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from ..envd.protocol import ENVD_PORT, file_signature
from ..orchestrator import SandboxRecord, SandboxState
from ..web import SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, BadTarget, send_error
from ..web.routing import SandboxRouting

FILES_PATH = "/files"


class SignedFileRouter:
    def __init__(self, app: ASGIApp, records: Callable[[], Iterable[SandboxRecord]],
                 domain: str):
        self.app = app
        self.records = records
        self.routing = SandboxRouting(domain)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != FILES_PATH:
            await self.app(scope, receive, send)
            return
        try:
            addressed = self.routing.target(scope) is not None
        except BadTarget:
            addressed = True  # the proxy answers it
        if addressed:
            await self.app(scope, receive, send)
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                               keep_blank_values=True))
        signature = query.get("signature")
        if not signature:
            await self.app(scope, receive, send)
            return
        sandbox_id = self._signer(query, signature, "read" if scope["method"] == "GET" else "write")
        if sandbox_id is None:
            await send_error(scope, send, 401, "the file URL's signature matches no running "
                             "sandbox (or it is for the other operation)")
            return
        routed = dict(scope)
        routed["headers"] = [*scope["headers"], (SANDBOX_ID_HEADER.encode(), sandbox_id.encode()),
                             (SANDBOX_PORT_HEADER.encode(), str(ENVD_PORT).encode())]
        await self.app(routed, receive, send)

    def _signer(self, query: dict[str, str], signature: str, operation: str) -> str | None:
        expiration = None
        if query.get("signature_expiration"):
            try:
                expiration = int(query["signature_expiration"])
            except ValueError:
                return None
        for record in self.records():
            if record.state is not SandboxState.RUNNING or not record.envd_token:
                continue
            expected = file_signature(query.get("path", ""), operation,
                                      query.get("username", ""), record.envd_token, expiration)
            if hmac.compare_digest(expected.encode(), signature.encode()):
                return record.sandbox_id
        return None

