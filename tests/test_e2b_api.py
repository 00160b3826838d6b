"""Templates as the SDK's API client parses them, and errors as the SDK raises them."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from e2b import (
    AuthenticationException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    Template,
    TimeoutException,
)
from e2b.api.client.api.templates import (
    get_templates,
    get_templates_template_id,
    get_v2_templates,
)
from e2b.api.client.models import Template as ApiTemplate
from e2b.api.client.models import TemplateBuildStatus, TemplateWithBuilds
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig

from agentenv.testing import Node


@pytest.fixture
def client(node: Node):
    return get_api_client(ConnectionConfig())


# -- templates --------------------------------------------------------------------

def test_list_templates_v1(client) -> None:
    res = get_templates.sync_detailed(client=client)
    assert res.status_code == 200
    by_id = {t.template_id: t for t in res.parsed}
    assert all(isinstance(t, ApiTemplate) for t in res.parsed)
    base = by_id["base"]
    assert base.aliases == ["base"] and base.names == ["base"]
    assert base.cpu_count == 2 and base.memory_mb == 512
    assert base.build_status == TemplateBuildStatus.READY
    assert base.envd_version and base.build_id
    assert base.public is True and base.created_by is None


def test_list_templates_v2_pages(client) -> None:
    res = get_v2_templates.sync_detailed(client=client)
    assert res.status_code == 200
    every = [t.template_id for t in res.parsed]
    assert "base" in every
    if len(every) > 1:
        first = get_v2_templates.sync_detailed(client=client, limit=1)
        assert [t.template_id for t in first.parsed] == every[:1]
        token = first.headers["x-next-token"]
        rest = get_v2_templates.sync_detailed(client=client, next_token=token)
        assert [t.template_id for t in rest.parsed] == every[1:]
        assert "x-next-token" not in rest.headers


def test_template_detail_and_alias(client) -> None:
    res = get_templates_template_id.sync_detailed("base", client=client)
    assert res.status_code == 200 and isinstance(res.parsed, TemplateWithBuilds)
    assert res.parsed.template_id == "base" and len(res.parsed.builds) == 1
    assert get_templates_template_id.sync_detailed("no-such", client=client).status_code == 404
    assert Template.exists("base") is True
    assert Template.exists("no-such-template") is False


@pytest.mark.needs_build("code-interpreter")
def test_code_interpreter_template_is_listed(client) -> None:
    by_id = {t.template_id: t for t in get_templates.sync_detailed(client=client).parsed}
    ci = by_id["code-interpreter"]
    assert "code-interpreter-v1" in ci.aliases  # the e2b-code-interpreter SDK's default
    assert Template.exists("code-interpreter-v1")


# -- errors -------------------------------------------------------------------------

def test_wrong_key_is_an_authentication_error(node: Node) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(template="base", api_key="aenv_wrong")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="aenv_wrong").next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.get_info("whatever", api_key="aenv_wrong")
    with pytest.raises(AuthenticationException):
        Template.exists("base", api_key="aenv_wrong")


def test_unknown_sandbox_is_not_found(node: Node) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("nosuchsandbox0000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("nosuchsandbox0000000")
    assert Sandbox.kill("nosuchsandbox0000000") is False


def test_gone_sandbox_through_envd_is_not_running(node: Node) -> None:
    sbx = Sandbox.create(template="base", timeout=60)
    sbx.kill()
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        sbx.files.read("/etc/hostname")
    with pytest.raises(SandboxNotFoundException):
        sbx.get_info()


def test_timeouts_are_timeout_errors(node: Node) -> None:
    sbx = Sandbox.create(template="base", timeout=120)
    try:
        # a command's own deadline
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 20", timeout=1)
        # a request's deadline on envd calls (RPC and HTTP)
        sbx.commands.run("mkdir /tmp/d && cd /tmp/d && touch $(seq 2000)")
        with pytest.raises(TimeoutException):
            sbx.files.list("/tmp/d", request_timeout=0.001)
        with pytest.raises(TimeoutException):
            sbx.is_running(request_timeout=0.0001)
        # the REST API's request deadline: the SDK surfaces httpx's own timeout
        with pytest.raises((TimeoutException, httpx.TimeoutException)):
            Sandbox.create(template="base", request_timeout=0.01)
    finally:
        sbx.kill()


def test_bad_requests_are_400(node: Node) -> None:
    with pytest.raises(Exception) as failed:
        Sandbox.create(template="base", timeout=-1)
    assert "400" in str(failed.value)
    with node.client() as api:
        r = api.post("/sandboxes", json={"timeout": 10})
        assert r.status_code == 400 and r.json()["code"] == 400
        r = api.get("/v2/sandboxes", params={"order": "sideways"})
        assert r.status_code == 400
        # a template filter names a template, not a build (E2B: a 400)
        r = api.get("/v2/sandboxes", params={"template": "base:default"})
        assert r.status_code == 400 and "tag" in r.json()["message"]
    with pytest.raises(SandboxException, match="tags are not supported"):
        Sandbox.list(query=SandboxQuery(template="base:v1")).next_items()
    with pytest.raises(SandboxException, match="400"):
        Sandbox.list(query=SandboxQuery(metadata={"a": "b"}), limit=1000).next_items()


def test_list_by_template_start_time_and_order(node: Node) -> None:
    tag = uuid.uuid4().hex
    first = Sandbox.create(template="base", timeout=120, metadata={"order": tag})
    time.sleep(0.05)
    second = Sandbox.create(template="base", timeout=120, metadata={"order": tag})
    try:
        q = SandboxQuery(metadata={"order": tag}, template="base")
        # newest first unless asked otherwise (E2B's default order)
        assert [s.sandbox_id for s in Sandbox.list(query=q).next_items()] == [
            second.sandbox_id, first.sandbox_id]
        newest_first = Sandbox.list(query=q, order="desc").next_items()
        assert [s.sandbox_id for s in newest_first] == [second.sandbox_id, first.sandbox_id]
        oldest_first = Sandbox.list(query=q, order="asc").next_items()
        assert [s.sandbox_id for s in oldest_first] == [first.sandbox_id, second.sandbox_id]
        other = SandboxQuery(metadata={"order": tag}, template="code-interpreter")
        assert Sandbox.list(query=other).next_items() == []
        for since, want in ((first, [first, second]), (second, [second])):
            after = SandboxQuery(metadata={"order": tag},
                                 started_after=since.get_info().started_at)
            assert [s.sandbox_id for s in Sandbox.list(query=after).next_items()] == [
                w.sandbox_id for w in reversed(want)]
        # startedBefore (the API's; the SDK has no field for it): "at or before", so a
        # window of one sandbox's own startedAt holds just it, every time.
        with node.client() as api:
            for box in (first, second):
                at = api.get(f"/sandboxes/{box.sandbox_id}").json()["startedAt"]
                listed = api.get("/v2/sandboxes", params={
                    "metadata": f"order={tag}", "startedAfter": at, "startedBefore": at}).json()
                assert [s["sandboxID"] for s in listed] == [box.sandbox_id]
            at = api.get(f"/sandboxes/{first.sandbox_id}").json()["startedAt"]
            listed = api.get("/v2/sandboxes", params={"metadata": f"order={tag}",
                                                      "startedBefore": at}).json()
            assert [s["sandboxID"] for s in listed] == [first.sandbox_id]
            r = api.get("/v2/sandboxes", params={"startedBefore": "yesterday"})
            assert r.status_code == 400 and "startedBefore" in r.json()["message"]
    finally:
        first.kill()
        second.kill()
