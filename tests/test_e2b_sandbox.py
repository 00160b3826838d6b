"""The official e2b SDK (Python, unchanged) drives sandboxes' lifecycle on a node.

Only the environment points the SDK at the node: E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY (set by the session's `node` fixture).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta

import httpx
import pytest
from e2b import (
    NotFoundException,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from agentenv.testing import Node


@pytest.fixture(scope="module")
def sbx(node: Node):
    sandbox = Sandbox.create(template="base", timeout=300, metadata={"suite": "sandbox"},
                             envs={"GREETING": "hello from envs"})
    yield sandbox
    sandbox.kill()


def test_create_with_template_metadata_envs_secure(node: Node) -> None:
    tag = uuid.uuid4().hex
    sandbox = Sandbox.create(template="base", timeout=120, metadata={"tag": tag},
                             envs={"A_VAR": "a value"}, secure=True)
    try:
        info = sandbox.get_info()
        assert info.template_id == "base" and info.name == "base"
        assert info.metadata == {"tag": tag}
        assert info.state == SandboxState.RUNNING
        assert info.cpu_count == 2 and info.memory_mb == 512
        assert info.envd_version and info.sandbox_domain == f"localhost:{node.port}"
        # timeout: the sandbox ends ~120 s after it started
        assert timedelta(seconds=115) < info.end_at - info.started_at < timedelta(seconds=125)
        assert sandbox.commands.run("echo $A_VAR").stdout == "a value\n"
        # secure: the SDK holds the envd access token and signs file URLs with it
        assert sandbox._envd_access_token
        assert "signature=" in sandbox.download_url("/etc/hostname")
    finally:
        sandbox.kill()


def test_create_without_internet_access(node: Node) -> None:
    sandbox = Sandbox.create(template="base", timeout=60, allow_internet_access=False)
    try:
        # The node wires the flag to the slot's egress policy (tests/test_egress.py
        # proves that end to end); here: the SDK's flag reaches the node and back.
        assert sandbox.get_info().allow_internet_access is False
    finally:
        sandbox.kill()
    sandbox = Sandbox.create(template="base", timeout=60, allow_internet_access=True)
    try:
        assert sandbox.get_info().allow_internet_access is True
    finally:
        sandbox.kill()


def test_connect_runs_in_the_same_sandbox(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/connect-marker", "same sandbox")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.sandbox_id == sbx.sandbox_id
    assert again.files.read("/home/user/connect-marker") == "same sandbox"
    assert again.commands.run("echo $GREETING").stdout == "hello from envs\n"


def test_connect_with_timeout_only_extends(sbx: Sandbox) -> None:
    sbx.set_timeout(300)
    end = sbx.get_info().end_at
    Sandbox.connect(sbx.sandbox_id, timeout=10)  # shorter: the TTL stays
    assert sbx.get_info().end_at == end
    Sandbox.connect(sbx.sandbox_id, timeout=600)  # longer: extended
    assert sbx.get_info().end_at > end + timedelta(seconds=250)


def test_set_timeout_moves_end(sbx: Sandbox) -> None:
    sbx.set_timeout(30)
    soon = sbx.get_info().end_at
    assert soon - datetime.now(soon.tzinfo) < timedelta(seconds=35)
    sbx.set_timeout(400)
    later = sbx.get_info().end_at
    assert later - soon > timedelta(seconds=300)
    # The class-level form works too.
    Sandbox.set_timeout(sbx.sandbox_id, 300)


def test_get_info_class_and_instance(sbx: Sandbox) -> None:
    a = sbx.get_info()
    b = Sandbox.get_info(sbx.sandbox_id)
    assert a.sandbox_id == b.sandbox_id == sbx.sandbox_id
    assert b.metadata == {"suite": "sandbox"}
    assert isinstance(b.started_at, datetime)


def test_kill_sandbox_while_command_is_running(node: Node) -> None:
    """E2B's own test (tests/sync/.../test_sandbox_killed_during_run.py): the kill cuts
    the command's stream, the SDK probes envd's /health through the proxy, gets a 502
    "was not found" and says the sandbox is gone (a TimeoutException)."""
    sandbox = Sandbox.create(template="base", timeout=60)
    cmd = sandbox.commands.run("sleep 60", background=True)
    sandbox.kill()
    with pytest.raises(TimeoutException) as exc_info:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(exc_info.value)


def test_kill_and_is_running(node: Node) -> None:
    sandbox = Sandbox.create(template="base", timeout=60)
    assert sandbox.is_running()
    assert sandbox.kill() in (None, True)
    assert not sandbox.is_running()
    assert Sandbox.kill(sandbox.sandbox_id) is False  # already gone: False, no error
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)


def test_list_filters_by_metadata_and_state(node: Node) -> None:
    tag = uuid.uuid4().hex
    made = [Sandbox.create(template="base", timeout=120, metadata={"tag": tag, "n": str(i),
                                                                    "odd space": "a b&c=d"})
            for i in range(3)]
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()
        assert {s.sandbox_id for s in found} == {s.sandbox_id for s in made}
        assert all(s.state == SandboxState.RUNNING and s.template_id == "base" for s in found)

        one = Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "n": "1"})).next_items()
        assert [s.sandbox_id for s in one] == [made[1].sandbox_id]
        # keys and values that need escaping survive the double encoding
        odd = Sandbox.list(query=SandboxQuery(metadata={"odd space": "a b&c=d", "tag": tag}))
        assert len(odd.next_items()) == 3

        running = Sandbox.list(query=SandboxQuery(metadata={"tag": tag},
                                                  state=[SandboxState.RUNNING])).next_items()
        assert len(running) == 3
        paused = Sandbox.list(query=SandboxQuery(metadata={"tag": tag},
                                                 state=[SandboxState.PAUSED])).next_items()
        assert paused == []
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": "no-such"})).next_items() == []
    finally:
        for s in made:
            s.kill()


def test_list_paginates_with_next_token(node: Node) -> None:
    tag = uuid.uuid4().hex
    made = [Sandbox.create(template="base", timeout=120, metadata={"page": tag})
            for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next and pager.next_token
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        seen = [s.sandbox_id for s in first + second]
        # newest first, E2B's default order
        assert seen == [s.sandbox_id for s in reversed(made)]

        # a token taken from one paginator resumes in another
        one = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=1)
        assert [s.sandbox_id for s in one.next_items()] == seen[:1]
        resumed = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2,
                               next_token=one.next_token)
        assert [s.sandbox_id for s in resumed.next_items()] == seen[1:]
        assert not resumed.has_next
    finally:
        for s in made:
            s.kill()


def test_list_newest_first_pages_stable_by_state(node: Node) -> None:
    """No ``order``: newest ``startedAt`` first (E2B's default), and the pages of each
    state filter neither repeat nor skip a sandbox, also when one is created between
    two pages (it is newer than the cursor: not on a later page)."""
    tag = uuid.uuid4().hex
    query = {"metadata": {"stable": tag}}
    made = [Sandbox.create(template="base", timeout=120, metadata={"stable": tag})
            for _ in range(4)]
    late: list[Sandbox] = []
    try:
        for s in made[1::2]:
            s.pause()
        newest = [s.sandbox_id for s in reversed(made)]
        paused = {s.sandbox_id for s in made[1::2]}

        def pages(state: list[SandboxState] | None, limit: int,
                  between=None) -> list[list[str]]:
            pager = Sandbox.list(query=SandboxQuery(**query, state=state), limit=limit)
            out = []
            while pager.has_next:
                out.append([i.sandbox_id for i in pager.next_items()])
                if between is not None and len(out) == 1:
                    between()
            return out

        both = pages(None, 3, between=lambda: late.append(
            Sandbox.create(template="base", timeout=120, metadata={"stable": tag})))
        assert both == [newest[:3], newest[3:]]
        running = pages([SandboxState.RUNNING], 1)
        want = [late[0].sandbox_id] + [i for i in newest if i not in paused]
        assert running == [[i] for i in want]
        assert pages([SandboxState.PAUSED], 1) == [[i] for i in newest if i in paused]
        assert pages([SandboxState.RUNNING, SandboxState.PAUSED], 2) == [
            [late[0].sandbox_id, *newest[:1]], newest[1:3], newest[3:]]
        oldest = Sandbox.list(query=SandboxQuery(**query), order="asc").next_items()
        assert [i.sandbox_id for i in oldest] == [*reversed(newest), late[0].sandbox_id]
        # a token is for the order it was issued in: replayed in the other, a clear 400
        with node.client() as api:
            r = api.get("/v2/sandboxes", params={"limit": 1,
                                                 "metadata": f"stable={tag}"})
            assert r.json()[0]["sandboxID"] == late[0].sandbox_id
            token = r.headers["x-next-token"]
            r = api.get("/v2/sandboxes", params={"nextToken": token, "order": "asc"})
            assert r.status_code == 400 and "order" in r.json()["message"]
            # the first listing (no paging) is newest first too
            first = [i["sandboxID"] for i in api.get("/sandboxes").json()
                     if i.get("metadata", {}).get("stable") == tag]
            assert first == [late[0].sandbox_id] + [i for i in newest if i not in paused]
    finally:
        for s in made + late:
            s.kill()


def test_list_raw_api_shapes(node: Node) -> None:
    """What the SDKs parse, checked at the HTTP level: header name, limits, bad input."""
    with node.client() as api:
        r = api.get("/v2/sandboxes", params={"limit": 0})
        assert r.status_code == 400 and r.json()["code"] == 400
        r = api.get("/v2/sandboxes", params={"state": "sleeping"})
        assert r.status_code == 400 and "state" in r.json()["message"]
        r = api.get("/v2/sandboxes", params={"nextToken": "!!not-a-token"})
        assert r.status_code == 400
        r = api.get("/v2/sandboxes", params={"state": "running,paused", "limit": 100})
        assert r.status_code == 200 and "x-next-token" not in r.headers
        # repeated state parameters (as the JS SDK sends them) work too
        r = api.get("/v2/sandboxes", params=[("state", "running"), ("state", "paused")])
        assert r.status_code == 200


def test_metrics(sbx: Sandbox) -> None:
    metrics = sbx.get_metrics()
    assert len(metrics) >= 1
    m = metrics[-1]
    assert m.cpu_count == 2
    assert 0 < m.mem_used < m.mem_total
    assert m.mem_total >= 500 * 1024 * 1024
    assert m.disk_total > 0
    assert abs((datetime.now(m.timestamp.tzinfo) - m.timestamp).total_seconds()) < 60
    # a window in the past holds no sample
    assert sbx.get_metrics(start=datetime.now() - timedelta(hours=2),
                           end=datetime.now() - timedelta(hours=1)) == []
    assert Sandbox.get_metrics(sbx.sandbox_id)


def test_metrics_of_many(node: Node, sbx: Sandbox) -> None:
    with node.client() as api:
        r = api.get("/sandboxes/metrics", params={"sandbox_ids": f"{sbx.sandbox_id},nope"})
    assert r.status_code == 200
    body = r.json()["sandboxes"]
    assert list(body) == [sbx.sandbox_id]
    assert body[sbx.sandbox_id]["memTotal"] > 0 and "timestampUnix" in body[sbx.sandbox_id]


def test_unknown_sandbox_is_not_found(node: Node) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("doesnotexist0000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout("doesnotexist0000000", 30)
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics("doesnotexist0000000")


def test_unknown_template_is_an_error(node: Node) -> None:
    with pytest.raises(Exception) as failed:
        Sandbox.create(template="no-such-template")
    assert "no-such-template" in str(failed.value)


def test_ttl_expiry_through_the_sdk_pauses_by_default(node: Node) -> None:
    sandbox = Sandbox.create(template="base", timeout=2)
    deadline = time.monotonic() + 20
    while sandbox.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    while sandbox.get_info().state.value != "paused" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sandbox.get_info().state.value == "paused"
    assert not sandbox.is_running()
    sandbox.kill()


def test_ttl_expiry_through_the_sdk_kills_when_asked(node: Node) -> None:
    sandbox = Sandbox.create(template="base", timeout=2, lifecycle={"on_timeout": "kill"})
    deadline = time.monotonic() + 20
    while sandbox.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not sandbox.is_running()
    with pytest.raises(SandboxNotFoundException):
        sandbox.get_info()


def test_refresh_route(node: Node, sbx: Sandbox) -> None:
    with node.client() as api:
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/refreshes", json={"duration": 120})
        assert r.status_code == 204
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/refreshes",
                        json={"duration": 99999}).status_code == 400
    left = sbx.get_info().end_at - datetime.now(sbx.get_info().end_at.tzinfo)
    assert timedelta(seconds=100) < left < timedelta(seconds=125)
    sbx.set_timeout(300)


def test_network_deny_all_means_no_internet(node: Node) -> None:
    sandbox = Sandbox.create(template="base", timeout=60,
                             network={"deny_out": ["0.0.0.0/0"]})
    try:
        assert sandbox.get_info().allow_internet_access is False
    finally:
        sandbox.kill()
    # Per-address rules exist (tests/test_security_egress.py); wildcards do not.
    with pytest.raises(Exception) as refused:
        Sandbox.create(template="base", timeout=60, network={"allow_out": ["*.example.com"]})
    assert "wildcard domains are not supported" in str(refused.value)


def test_api_is_plain_http_json(node: Node) -> None:
    r = httpx.get(node.url + "/v2/sandboxes", headers={"X-API-Key": node.api_key})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
