"""A client of the OCI distribution (registry v2) API: manifests and blobs.

Auth follows the registry's ``WWW-Authenticate`` challenge: Bearer (a token from
the realm, with basic credentials when given) or Basic. Documents are read with
a size cap before parsing; blobs are streamed (the caller verifies digests).

Every URL requested (the registry's, its token realm, each redirect, at most
MAX_REDIRECTS of them) is checked first by ``registry_hosts`` (no private or node
addresses, https, unless the operator allowed the registry); credentials go only to
the origin they are for (the token and Basic credentials to the registry, Basic
credentials to the realm), never along a redirect to another host; and an error
says what another host answered only as its status code (issue 29, finding 3).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urljoin

import httpx

from .errors import HostileInput, ImageNotFound, RegistryAuthError, RegistryUnavailable
from .manifest import ACCEPT, MAX_MANIFEST_BYTES
from .reference import DOCKER_HUB, RegistryRef
from .registry_hosts import MAX_REDIRECTS, RegistryPolicy, default_policy

log = logging.getLogger(__name__)
CHUNK = 1 << 20
_PARAM = re.compile(r'(\w+)="([^"]*)"')
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def _is_local(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0][1:]
    return name in ("localhost", "::1") or name.startswith("127.")


class RangeUnsupported(RegistryUnavailable):
    """The registry does not serve byte ranges of blobs."""


class RegistryClient:
    """One repository of one registry; holds its token for the pull."""

    def __init__(self, ref: RegistryRef, username: str = "", password: str = "",
                 timeout: float = 30.0, insecure: bool | None = None,
                 policy: RegistryPolicy | None = None):
        self.ref = ref
        self._auth = (username, password) if username or password else None
        # Plain HTTP only for loopback registries (tests, local mirrors).
        plain = _is_local(ref.registry) if insecure is None else insecure
        self.base = f"{'http' if plain else 'https'}://{ref.registry}/v2/{ref.repository}"
        self.policy = policy or default_policy()
        self._origin = _origin(httpx.URL(self.base))
        # Redirects are followed here, each checked; no default headers.
        self._client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                    follow_redirects=False, trust_env=False)
        self._token = ""
        self._basic = ""  # the Authorization value after a Basic challenge

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _login(self, challenge: str) -> None:
        scheme, _, params_text = challenge.partition(" ")
        params = dict(_PARAM.findall(params_text))
        if scheme.lower() == "basic":
            if self._auth is None:
                raise RegistryAuthError(f"{self.ref.registry} requires credentials")
            self._basic = _basic(*self._auth)
            return
        if scheme.lower() != "bearer" or "realm" not in params:
            raise RegistryAuthError(f"{self.ref.registry}: unsupported auth challenge {scheme!r}")
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        try:
            realm = httpx.URL(params["realm"]).copy_merge_params(query)
        except (httpx.InvalidURL, TypeError, ValueError) as exc:
            raise RegistryAuthError(f"{self.ref.registry}: its token realm is no URL") from exc
        creds = (_origin(realm), _basic(*self._auth)) if self._auth else None
        try:
            resp = self._open("GET", realm, {}, creds, "its token realm")
            try:
                data = _small(resp)
            finally:
                resp.close()
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"token server of {self.ref.registry}: "
                                      f"{type(exc).__name__}") from exc
        if resp.status_code in (401, 403):
            raise RegistryAuthError(f"{self.ref.registry}: credentials refused by the token "
                                    "server")
        if resp.status_code != 200:
            raise RegistryUnavailable(f"token server of {self.ref.registry} answered "
                                      f"{resp.status_code}")
        try:
            body = json.loads(data)
            token = body.get("token") or body["access_token"]
            if not isinstance(token, str) or not token.isprintable():
                raise ValueError("no token")
            self._token = token
        except (ValueError, KeyError, AttributeError) as exc:
            raise RegistryUnavailable(f"token server of {self.ref.registry}: no token") from exc

    def _registry_auth(self) -> tuple[str, str] | None:
        value = f"Bearer {self._token}" if self._token else self._basic
        return (self._origin, value) if value else None

    def _open(self, method: str, url: httpx.URL | str, headers: dict[str, str],
              auth: tuple[str, str] | None, what: str = "the registry",
              content: Iterator[bytes] | bytes | None = None) -> httpx.Response:
        """The answer (streamed: the caller closes it) after following at most
        MAX_REDIRECTS redirects, each target checked first; ``auth`` is (origin,
        Authorization value), sent to that origin only."""
        target = httpx.URL(url)
        for hop in range(MAX_REDIRECTS + 1):
            self.policy.check(target, self.ref.registry, what if hop == 0 else
                              f"a redirect of {what}")
            sent = dict(headers)
            if auth is not None and _origin(target) == auth[0]:
                sent["Authorization"] = auth[1]
            request = self._client.build_request(method, target, headers=sent,
                                                 content=content if hop == 0 else None)
            resp = self._client.send(request, stream=True)
            location = resp.headers.get("location")
            if resp.status_code not in _REDIRECTS or not location:
                return resp
            resp.close()
            try:
                target = target.join(location)
            except httpx.InvalidURL as exc:
                raise RegistryUnavailable(f"{self.ref.registry}: a redirect of {what} is "
                                          "no URL") from exc
            if resp.status_code == 303:
                method = "GET"
        raise RegistryUnavailable(f"{self.ref.registry}: more than {MAX_REDIRECTS} redirects "
                                  f"for {what}; refused")

    @contextlib.contextmanager
    def _get(self, url: str, accept: str = "",
             extra: dict[str, str] | None = None) -> Iterator[httpx.Response]:
        for attempt in range(2):
            headers = {"Accept": accept} if accept else {}
            headers.update(extra or {})
            try:
                resp = self._open("GET", url, headers, self._registry_auth())
                try:
                    if resp.status_code == 401 and attempt == 0 and self._own(resp):
                        self._login(resp.headers.get("www-authenticate", ""))
                        continue
                    self._check(resp, url)
                    yield resp
                    return
                finally:
                    resp.close()
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(f"{self.ref.registry} unreachable: "
                                          f"{type(exc).__name__}") from exc
        raise RegistryAuthError(f"{self.ref.registry}: access to {self.ref.repository} denied")

    def _own(self, resp: httpx.Response) -> bool:
        """Whether the answer is the registry's own (not a redirect target's)."""
        return _origin(resp.url) == self._origin

    def _check(self, resp: httpx.Response, url: str) -> None:
        code = resp.status_code
        if code in (200, 206):
            return
        if not self._own(resp):  # another host: its status alone, nothing it said
            raise RegistryUnavailable(f"{self.ref.registry}: the host it redirected to "
                                      f"answered {code}")
        if code in (401, 403):
            raise RegistryAuthError(f"{self.ref.registry}: access to {self.ref.repository} "
                                    f"denied ({code})")
        if code == 404:
            what = url.rsplit("/", 2)
            raise ImageNotFound(f"{self.ref.registry}/{self.ref.repository}: {what[-2][:-1]} "
                                f"{what[-1]} not found")
        if code == 429 or code >= 500:
            raise RegistryUnavailable(f"{self.ref.registry} answered {code}")
        raise RegistryUnavailable(f"{self.ref.registry} answered {code} for {url}")

    def manifest(self, reference: str) -> tuple[bytes, str]:
        """The raw manifest or index and its media type; refuses documents over the cap."""
        with self._get(f"{self.base}/manifests/{reference}", accept=ACCEPT) as resp:
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > MAX_MANIFEST_BYTES:
                raise HostileInput(f"manifest {reference} is {declared} bytes; at most "
                                   f"{MAX_MANIFEST_BYTES} are accepted")
            data = _read_capped(resp, MAX_MANIFEST_BYTES, f"manifest {reference}")
            return data, resp.headers.get("content-type", "") if self._own(resp) else ""

    def blob_bytes(self, digest: str, limit: int) -> bytes:
        with self._get(f"{self.base}/blobs/{digest}") as resp:
            return _read_capped(resp, limit, f"blob {digest}")

    def blob_range(self, digest: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the blob from ``offset`` (an HTTP Range request); a
        registry that answers with the whole blob instead is refused, not read."""
        if offset < 0 or length <= 0:
            raise ValueError(f"bad range {offset}+{length}")
        last = offset + length - 1
        with self._get(f"{self.base}/blobs/{digest}",
                       extra={"Range": f"bytes={offset}-{last}"}) as resp:
            if resp.status_code != 206:
                raise RangeUnsupported(f"{self.ref.registry} answered {resp.status_code} to a "
                                       f"range request for blob {digest}")
            got = resp.headers.get("content-range", "")
            if not got.startswith(f"bytes {offset}-{last}/"):
                raise HostileInput(f"{self.ref.registry}: blob {digest}: asked for bytes "
                                   f"{offset}-{last}, got {got[:100]!r}")
            data = _read_capped(resp, length, f"range of blob {digest}")
        if len(data) != length:
            raise RegistryUnavailable(f"{self.ref.registry}: blob {digest}: {len(data)} of "
                                      f"{length} bytes from {offset}")
        return data

    @contextlib.contextmanager
    def blob(self, digest: str) -> Iterator[Iterator[bytes]]:
        with self._get(f"{self.base}/blobs/{digest}") as resp:
            yield _guarded(resp.iter_raw(CHUNK), self.ref.registry)


    # -- pushing (``aenv image convert``) ------------------------------------------------

    def _send(self, method: str, url: str, headers: dict[str, str] | None = None,
              body: Callable[[], Iterator[bytes] | bytes] | None = None) -> httpx.Response:
        """One request that writes, logging in on the registry's challenge (the token
        for a push has the push scope the challenge names)."""
        for attempt in range(2):
            try:
                resp = self._open(method, url, dict(headers or {}), self._registry_auth(),
                                  content=body() if body else None)
                try:
                    data = _small(resp)
                finally:
                    resp.close()
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(f"{self.ref.registry} unreachable: "
                                          f"{type(exc).__name__}") from exc
            if resp.status_code == 401 and attempt == 0:
                self._login(resp.headers.get("www-authenticate", ""))
                continue
            if resp.status_code in (401, 403):
                raise RegistryAuthError(f"{self.ref.registry}: push to {self.ref.repository} "
                                        f"denied ({resp.status_code})")
            if resp.status_code >= 400:
                said = f": {data[:200].decode(errors='replace')}" if self._own(resp) else ""
                raise RegistryUnavailable(f"{self.ref.registry} answered {resp.status_code} to "
                                          f"{method} {url.split('?')[0]}{said}")
            return resp
        raise RegistryAuthError(f"{self.ref.registry}: push to {self.ref.repository} denied")

    def push_blob(self, path: Path, digest: str) -> None:
        """The file as blob ``digest`` (one monolithic upload), unless it is there."""
        try:
            if self._send("HEAD", f"{self.base}/blobs/{digest}").status_code == 200:
                return
        except RegistryUnavailable:
            pass  # 404: not there
        start = self._send("POST", f"{self.base}/blobs/uploads/")
        location = urljoin(f"{self.base}/", start.headers.get("location", ""))
        sep = "&" if "?" in location else "?"

        def content() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(CHUNK):
                    yield piece

        self._send("PUT", f"{location}{sep}digest={digest}", body=content,
                   headers={"Content-Type": "application/octet-stream",
                            "Content-Length": str(path.stat().st_size)})

    def push_manifest(self, reference: str, data: bytes, media_type: str) -> None:
        self._send("PUT", f"{self.base}/manifests/{reference}", body=lambda: data,
                   headers={"Content-Type": media_type})


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"


def _basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def _small(resp: httpx.Response, limit: int = 1 << 20) -> bytes:
    """At most ``limit`` bytes of an answer that should be small (the rest unread)."""
    out = bytearray()
    for chunk in resp.iter_bytes(CHUNK):
        out += chunk
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _guarded(chunks: Iterator[bytes], registry: str) -> Iterator[bytes]:
    try:
        yield from chunks
    except httpx.HTTPError as exc:
        raise RegistryUnavailable(f"{registry}: blob download failed: {exc}") from exc


def _read_capped(resp: httpx.Response, limit: int, what: str) -> bytes:
    out = bytearray()
    for chunk in resp.iter_raw(CHUNK):
        out += chunk
        if len(out) > limit:
            raise HostileInput(f"{what} is larger than {limit} bytes; refused")
    return bytes(out)


__all__ = ["DOCKER_HUB", "RangeUnsupported", "RegistryClient"]
