"""Image pulls stay on their registry (issue 29, finding 3): a registry's token realm
and redirects are checked as its own address is, hops are bounded, credentials never
follow a redirect to another host, and errors do not repeat what another host said.

A small "registry" on loopback answers as each test needs; "internal" services beside
it on loopback count what reached them. The project's test registry (docker-registry
with its token server) still pulls when the operator lists its ports.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentenv.images import RegistryUnavailable
from agentenv.images.reference import RegistryRef
from agentenv.images.registry_client import RegistryClient
from agentenv.images.registry_hosts import RegistryPolicy, RegistryTargetRefused
from agentenv.testing.oci_registry import RegistryServer, build_image, tar_layer

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class Server:
    """An HTTP server on 127.0.0.1:<free port>, recording each request's path and
    Authorization header, answering with ``handle``."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.seen: list[tuple[str, str]] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.seen.append((self.path, self.headers.get("Authorization", "")))
                outer.handle(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def answer(status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> Handler:
    def handle(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return handle


@pytest.fixture
def internal() -> Iterator[Server]:
    """A service on the node's loopback that no pull may reach."""
    server = Server(answer(500, {"Content-Type": "x-internal/secret-type"}, b"INTERNAL-SECRET"))
    yield server
    server.close()


@pytest.fixture
def registry() -> Iterator[Server]:
    server = Server(answer(404))
    yield server
    server.close()


def client(registry: Server, *allowed: str, user: str = "", password: str = "") -> RegistryClient:
    """A client of ``registry`` whose operator listed only ``allowed`` (and it)."""
    host = f"127.0.0.1:{registry.port}"
    return RegistryClient(RegistryRef(host, "team/app", "latest"), user, password,
                          policy=RegistryPolicy((host, *allowed)))


def test_token_realm_elsewhere_on_loopback_is_not_fetched(registry: Server,
                                                          internal: Server) -> None:
    realm = f"http://127.0.0.1:{internal.port}/internal/token"
    registry.handle = answer(401, {"WWW-Authenticate": f'Bearer realm="{realm}",service="x"'})
    with client(registry, user="u", password="p") as c, \
            pytest.raises(RegistryTargetRefused, match="token realm") as err:
        c.manifest("latest")
    assert internal.seen == []  # never asked, so no credentials and no token went there
    assert "secret" not in str(err.value).lower()


def test_redirects_are_checked_bounded_and_never_carry_credentials(
        registry: Server, internal: Server) -> None:
    # To an unlisted loopback port: refused before any request is sent there.
    registry.handle = answer(302, {"Location": f"http://127.0.0.1:{internal.port}/x"})
    with client(registry) as c, pytest.raises(RegistryTargetRefused, match="redirect"):
        c.manifest("latest")
    assert internal.seen == []
    # To a host the operator listed: followed, without the registry's credentials, and
    # its answer is reported by status alone.
    registry.handle = answer(307, {"Location": f"http://localhost:{internal.port}/blob"})
    with client(registry, f"localhost:{internal.port}", user="u", password="p") as c, \
            pytest.raises(RegistryUnavailable) as err:
        c._basic = "Basic dTpw"  # as after the registry's Basic challenge
        c.blob_bytes("sha256:" + "0" * 64, 1024)
    assert internal.seen == [("/blob", "")], internal.seen
    assert registry.seen[-1][1] == "Basic dTpw"  # the registry itself got them
    message = str(err.value)
    assert "500" in message and "secret" not in message.lower(), message
    # A registry redirecting to itself for ever: at most 5 hops, then refused.
    registry.seen.clear()
    registry.handle = answer(302, {"Location": "/v2/loop"})
    with client(registry) as c, pytest.raises(RegistryUnavailable, match="more than 5"):
        c.manifest("latest")
    assert len(registry.seen) == 6


def test_plain_http_and_private_addresses_need_the_operator(internal: Server) -> None:
    policy = RegistryPolicy(())  # registry_private = []: loopback refused too
    ref = RegistryRef(f"127.0.0.1:{internal.port}", "team/app", "latest")
    with RegistryClient(ref, policy=policy) as c, \
            pytest.raises(RegistryTargetRefused, match="plain http"):
        c.manifest("latest")
    with RegistryClient(ref, insecure=False, policy=policy) as c, \
            pytest.raises(RegistryTargetRefused, match="loopback, private"):
        c.manifest("latest")
    assert internal.seen == []


def test_the_test_registry_pulls_with_its_ports_listed(tmp_path: Path) -> None:
    with RegistryServer(tmp_path / "reg", auth=True) as reg:
        reg.push("private/app", "v1", build_image([tar_layer([])]))
        assert reg.tokens is not None
        ref = RegistryRef(reg.host, "private/app", "v1")
        listed = RegistryPolicy((reg.host, f"127.0.0.1:{reg.tokens.port}"))
        with RegistryClient(ref, reg.username, reg.password, policy=listed) as c:
            data, _ = c.manifest("v1")
        assert b"layers" in data
        # Its token server's port unlisted: the realm is refused.
        only = RegistryPolicy((reg.host,))
        with RegistryClient(ref, reg.username, reg.password, policy=only) as c, \
                pytest.raises(RegistryTargetRefused, match="token realm"):
            c.manifest("v1")
