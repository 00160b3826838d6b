"""Issue 12, finding 1: the node's sandbox proxy as an SSRF, with no API key.

Before the fix, ``GET @127.0.0.1:<port>/x`` with ``Host: 49983-<id>.localhost`` (or the
``E2b-Sandbox-*`` headers) made the node fetch a listener on its own loopback and
return its answer; the routing headers also reached the sandbox."""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node
from proxy_attacks import (
    assert_bad_routing_is_400,
    assert_no_ssrf,
    assert_routing_headers_stripped,
    start_header_echo,
)


@pytest.fixture(scope="module")
def sandbox(node: Node):
    sbx = Sandbox.create(template="base", timeout=300)
    yield sbx
    sbx.kill()


def test_hostile_request_targets_never_reach_the_host(node: Node, sandbox: Sandbox) -> None:
    assert_no_ssrf(node.port, sandbox.sandbox_id)
    # The node still serves, and the sandbox still answers through the proxy.
    assert httpx.get(f"{node.url}/health").status_code == 200
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"


def test_malformed_routing_is_a_clear_400(node: Node, sandbox: Sandbox) -> None:
    assert_bad_routing_is_400(node.port, sandbox.sandbox_id)


def test_sandbox_never_sees_routing_headers_or_the_key(node: Node, sandbox: Sandbox) -> None:
    start_header_echo(sandbox)
    assert_routing_headers_stripped(node.port, sandbox.sandbox_id)


def test_api_document_wants_the_key(node: Node) -> None:
    assert httpx.get(f"{node.url}/openapi.json").status_code == 401
    assert httpx.get(f"{node.url}/docs").status_code in (401, 404)
    r = httpx.get(f"{node.url}/openapi.json", headers={"X-API-Key": node.api_key})
    assert r.status_code == 200 and "/sandboxes" in r.json()["paths"]
