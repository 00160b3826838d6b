"""Several URLs of one service (gateways, all serving the same cluster): a client
tries them in turn, the last that answered first.

Gateways are stateless apart from Redis, so any one serves any request. A request
moves to the next URL only when connecting failed (``ConnectError`` or
``ConnectTimeout``): nothing of it reached a server, so any method is safe to send
again. A request whose answer was lost after it was sent is its caller's to retry
(the RL client does, creates under one ``Idempotency-Key``).

Used by the ``aenv`` CLI and the RL client (``agentenv.rl``), as an httpx transport:
the client keeps the first URL as its base, and the transport sends each request
for it to the URL whose turn it is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import httpx

log = logging.getLogger(__name__)
_CONNECT_FAILED = (httpx.ConnectError, httpx.ConnectTimeout)


def split_urls(value: str | Sequence[str]) -> list[str]:
    """One URL, several comma-separated, or a list: each http(s), without a trailing /."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    urls = [u.strip().rstrip("/") for u in parts if u.strip()]
    if not urls:
        raise ValueError("no server URL given")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"invalid URL '{url}': expected http://... or https://...")
    return urls


class Rotation:
    """The URLs and whose turn it is (shared by every request of one client)."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        self.urls = split_urls(urls)
        self._first = 0

    @property
    def current(self) -> str:
        """The URL that answered last (the first one until one failed)."""
        return self.urls[self._first]

    def order(self) -> list[str]:
        return self.urls[self._first:] + self.urls[:self._first]

    def answered(self, url: str) -> None:
        self._first = self.urls.index(url)

    def aimed(self, request: httpx.Request, url: str) -> httpx.Request:
        """``request`` sent to ``url`` instead of the first URL (a request for
        anywhere else, such as an absolute URL of another host, goes unchanged)."""
        primary, wanted = str(request.url), self.urls[0]
        if url == wanted or not primary.startswith(wanted):
            return request
        target = httpx.URL(url + primary[len(wanted):])
        # Given a stream, httpx sets no Host of its own: the new one goes in here.
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
        headers.insert(0, (b"Host", target.netloc))
        return httpx.Request(request.method, target, headers=headers,
                             stream=request.stream, extensions=request.extensions)


class FailoverTransport(httpx.BaseTransport):
    def __init__(self, urls: str | Sequence[str], transport: httpx.BaseTransport | None = None
                 ) -> None:
        self.rotation = Rotation(urls)
        self.transport = transport or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        failure: Exception | None = None
        for url in self.rotation.order():
            try:
                response = self.transport.handle_request(self.rotation.aimed(request, url))
            except _CONNECT_FAILED as exc:
                log.info("%s unreachable (%s): trying the next URL", url, exc)
                failure = exc
                continue
            self.rotation.answered(url)
            return response
        assert failure is not None
        raise failure

    def close(self) -> None:
        self.transport.close()


class AsyncFailoverTransport(httpx.AsyncBaseTransport):
    def __init__(self, urls: str | Sequence[str],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.rotation = Rotation(urls)
        self.transport = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        failure: Exception | None = None
        for url in self.rotation.order():
            try:
                response = await self.transport.handle_async_request(
                    self.rotation.aimed(request, url))
            except _CONNECT_FAILED as exc:
                log.info("%s unreachable (%s): trying the next URL", url, exc)
                failure = exc
                continue
            self.rotation.answered(url)
            return response
        assert failure is not None
        raise failure

    async def aclose(self) -> None:
        await self.transport.aclose()
