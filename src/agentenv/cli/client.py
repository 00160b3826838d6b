"""The node's HTTP API as the CLI uses it: errors as one line, IDs by unique prefix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from ..failover import FailoverTransport
from .config import CliError, Credentials, credentials


class ApiError(CliError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, creds: Credentials | None = None, timeout: float = 120):
        self.creds = creds or credentials()
        # Several gateways' URLs: a request that cannot connect to one goes to the next.
        try:
            self.transport = FailoverTransport(self.creds.url)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        self.http = httpx.Client(base_url=self.transport.rotation.urls[0], timeout=timeout,
                                 trust_env=False, transport=self.transport,
                                 headers={"X-API-Key": self.creds.key})

    @property
    def url(self) -> str:
        """The server URL that answered last (of several gateways' URLs)."""
        return self.transport.rotation.current

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach {self.creds.url}: {exc or type(exc).__name__}") from exc
        if r.status_code >= 400:
            raise _api_error(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.request(method, path, **kw)
        return r.json() if r.content else None

    def lines(self, method: str, path: str, **kw: Any) -> Iterator[Any]:
        """An NDJSON answer, one object at a time as the node sends it."""
        headers = {**kw.pop("headers", {}), "Accept": "application/x-ndjson"}
        try:
            with self.http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _api_error(r)
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach {self.creds.url}: {exc or type(exc).__name__}") from exc

    # -- listings -----------------------------------------------------------------

    def sandboxes(self, states: list[str] | None = None,
                  metadata: dict[str, str] | None = None) -> list[dict]:
        from urllib.parse import quote, urlencode

        params: dict[str, Any] = {"limit": 100}
        if states:
            params["state"] = ",".join(states)
        if metadata:
            params["metadata"] = urlencode({quote(k, safe=""): quote(v, safe="")
                                            for k, v in metadata.items()})
        out: list[dict] = []
        while True:
            r = self.request("GET", "/v2/sandboxes", params=params)
            out += r.json()
            token = r.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    def snapshots(self, sandbox_id: str | None = None) -> list[dict]:
        params = {"sandboxID": sandbox_id} if sandbox_id else {}
        return self.json("GET", "/snapshots", params=params)

    # -- IDs by prefix --------------------------------------------------------------

    def resolve(self, prefix: str) -> str:
        """The sandbox whose ID is ``prefix`` or starts with it (running or paused)."""
        ids = [s["sandboxID"] for s in self.sandboxes()]
        return _unique(prefix, ids, "sandbox")

    def resolve_snapshot(self, ref: str) -> str:
        """A snapshot by name, full ID or unique ID prefix."""
        snaps = self.snapshots()
        for s in snaps:
            if ref in s.get("names", []):
                return s["snapshotID"]
        return _unique(ref, [s["snapshotID"] for s in snaps], "snapshot")


def _unique(prefix: str, ids: list[str], kind: str) -> str:
    if not prefix:
        raise CliError(f"empty {kind} ID")
    if prefix in ids:
        return prefix
    matches = sorted(i for i in ids if i.startswith(prefix))
    if not matches:
        raise CliError(f"no {kind} matches '{prefix}'")
    if len(matches) > 1:
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        raise CliError(f"'{prefix}' is ambiguous: it matches {len(matches)} {kind}s ({shown})")
    return matches[0]


def sdk_sandbox(c: Client, sid: str):
    """The e2b SDK's Sandbox for ``sid``, pointed at this node."""
    from e2b import Sandbox

    url = c.url
    try:
        return Sandbox.connect(sid, api_key=c.creds.key, api_url=url, sandbox_url=url)
    except Exception as exc:
        raise CliError(f"cannot connect to sandbox {sid}: {exc}") from exc


def _api_error(r: httpx.Response) -> ApiError:
    try:
        message = r.json().get("message") or r.text
    except ValueError:
        message = r.text or r.reason_phrase
    if r.status_code == 401:
        message = f"{message} (run `aenv auth`)"
    return ApiError(r.status_code, message)
