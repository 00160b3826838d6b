"""The RL client's calls to a node or gateway: retries that respect ``Retry-After``.

A busy server answers 429 (its admission queue's wait ran out) or 503 (no room now)
with ``Retry-After``; those calls, and ones that never reached an answer, are retried
after the server's wait (or an exponential backoff) plus jitter, until a deadline.
Creates carry one ``Idempotency-Key`` over all their tries, so a retry after a lost
answer returns the sandbox the first try made instead of making a second.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ..failover import AsyncFailoverTransport

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class ApiError(Exception):
    """An answer the client does not retry (or the last one before the deadline)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RetryPolicy:
    deadline_s: float = 300.0  # give up on one call after this long
    base_s: float = 0.25  # first backoff when the server names no wait
    max_s: float = 10.0  # longest single wait, whatever the server asks
    jitter: float = 0.5  # up to this fraction added to each wait, at random

    def wait(self, attempt: int, retry_after: float | None) -> float:
        base = retry_after if retry_after is not None else self.base_s * 2 ** attempt
        base = min(max(base, 0.0), self.max_s)
        return base * (1 + random.uniform(0, self.jitter))


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date."""
    raw = response.headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return str(body)[:500]


def failover_client(urls: str | Sequence[str], max_connections: int,
                    timeout_s: float = 120.0, **kw: Any) -> httpx.AsyncClient:
    """An HTTP client of a node, or of one or several gateways (comma-separated URLs
    or a list): a request that cannot connect to one goes to the next."""
    transport = AsyncFailoverTransport(urls, httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections)))
    return httpx.AsyncClient(base_url=transport.rotation.urls[0], transport=transport,
                             timeout=httpx.Timeout(timeout_s, connect=10.0), **kw)


class Api:
    """The REST API of a node (or gateways) with an API key."""

    def __init__(self, url: str | Sequence[str], api_key: str,
                 retry: RetryPolicy | None = None, max_connections: int = 64,
                 timeout_s: float = 120.0) -> None:
        self.retry = retry or RetryPolicy()
        # How many answers asked for a retry, by status (0: no answer): counts, not a
        # list, so a client that runs for days holds a few integers.
        self.refusals: collections.Counter[int] = collections.Counter()
        self.client = failover_client(url, max_connections, timeout_s,
                                      headers={"X-API-Key": api_key})

    async def aclose(self) -> None:
        await self.client.aclose()

    async def call(self, method: str, path: str, *, json: Any = None,
                   params: dict[str, str] | None = None,
                   headers: dict[str, str] | None = None,
                   ok: tuple[int, ...] = (200, 201, 204), retry_errors: bool = True,
                   deadline_s: float | None = None) -> httpx.Response:
        """One API call, retried on 429/502/503/504 (and on a lost answer if
        ``retry_errors``: only for calls safe to repeat) until the deadline."""
        deadline = time.monotonic() + (deadline_s or self.retry.deadline_s)
        attempt = 0
        while True:
            wait: float | None
            try:
                r = await self.client.request(method, path, json=json, params=params,
                                              headers=headers)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                if not retry_errors or time.monotonic() >= deadline:
                    raise ApiError(0, f"{method} {path}: {e!r}") from e
                wait = None
                last, last_status = f"{e!r}", 0
            else:
                if r.status_code in ok:
                    return r
                if r.status_code not in RETRY_STATUSES or time.monotonic() >= deadline:
                    raise ApiError(r.status_code, _message(r))
                wait = retry_after(r)
                last, last_status = _message(r), r.status_code
            self.refusals[last_status] += 1
            pause = self.retry.wait(attempt, wait)
            if time.monotonic() + pause >= deadline:
                raise ApiError(last_status,
                               f"{method} {path}: gave up at the deadline: {last}")
            await asyncio.sleep(pause)
            attempt += 1
