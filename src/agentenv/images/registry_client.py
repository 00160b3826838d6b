"""A client of the OCI distribution (registry v2) API: manifests and blobs.

Auth follows the registry's ``WWW-Authenticate`` challenge: Bearer (a token from
the realm, with basic credentials when given) or Basic. Documents are read with
a size cap before parsing; blobs are streamed (the caller verifies digests).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urljoin

import httpx

from .errors import HostileInput, ImageNotFound, RegistryAuthError, RegistryUnavailable
from .manifest import ACCEPT, MAX_MANIFEST_BYTES
from .reference import DOCKER_HUB, RegistryRef

log = logging.getLogger(__name__)
CHUNK = 1 << 20
_PARAM = re.compile(r'(\w+)="([^"]*)"')


def _is_local(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0][1:]
    return name in ("localhost", "::1") or name.startswith("127.")


class RangeUnsupported(RegistryUnavailable):
    """The registry does not serve byte ranges of blobs."""


class RegistryClient:
    """One repository of one registry; holds its token for the pull."""

    def __init__(self, ref: RegistryRef, username: str = "", password: str = "",
                 timeout: float = 30.0, insecure: bool | None = None):
        self.ref = ref
        self._auth = (username, password) if username or password else None
        # Plain HTTP only for loopback registries (tests, local mirrors).
        plain = _is_local(ref.registry) if insecure is None else insecure
        self.base = f"{'http' if plain else 'https'}://{ref.registry}/v2/{ref.repository}"
        self._client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                    follow_redirects=True)
        self._token = ""

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
            self._client.auth = httpx.BasicAuth(*self._auth)
            return
        if scheme.lower() != "bearer" or "realm" not in params:
            raise RegistryAuthError(f"{self.ref.registry}: unsupported auth challenge {scheme!r}")
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        try:
            resp = self._client.get(params["realm"], params=query,
                                    auth=httpx.BasicAuth(*self._auth) if self._auth else None)
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"token server of {self.ref.registry}: {exc}") from exc
        if resp.status_code in (401, 403):
            raise RegistryAuthError(f"{self.ref.registry}: credentials refused by the token "
                                    "server")
        if resp.status_code != 200:
            raise RegistryUnavailable(f"token server of {self.ref.registry} answered "
                                      f"{resp.status_code}")
        try:
            body = resp.json()
            self._token = body.get("token") or body["access_token"]
        except (ValueError, KeyError) as exc:
            raise RegistryUnavailable(f"token server of {self.ref.registry}: no token") from exc

    @contextlib.contextmanager
    def _get(self, url: str, accept: str = "",
             extra: dict[str, str] | None = None) -> Iterator[httpx.Response]:
        for attempt in range(2):
            headers = {"Accept": accept} if accept else {}
            headers.update(extra or {})
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            try:
                with self._client.stream("GET", url, headers=headers) as resp:
                    if resp.status_code == 401 and attempt == 0:
                        self._login(resp.headers.get("www-authenticate", ""))
                        continue
                    self._check(resp, url)
                    yield resp
                    return
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(f"{self.ref.registry} unreachable: {exc}") from exc
        raise RegistryAuthError(f"{self.ref.registry}: access to {self.ref.repository} denied")

    def _check(self, resp: httpx.Response, url: str) -> None:
        code = resp.status_code
        if code in (200, 206):
            return
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
            return data, resp.headers.get("content-type", "")

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
            sent = dict(headers or {})
            if self._token:
                sent["Authorization"] = f"Bearer {self._token}"
            try:
                resp = self._client.request(method, url, headers=sent,
                                            content=body() if body else None)
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(f"{self.ref.registry} unreachable: {exc}") from exc
            if resp.status_code == 401 and attempt == 0:
                self._login(resp.headers.get("www-authenticate", ""))
                continue
            if resp.status_code in (401, 403):
                raise RegistryAuthError(f"{self.ref.registry}: push to {self.ref.repository} "
                                        f"denied ({resp.status_code})")
            if resp.status_code >= 400:
                raise RegistryUnavailable(f"{self.ref.registry} answered {resp.status_code} to "
                                          f"{method} {url.split('?')[0]}: {resp.text[:200]}")
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
