"""Template builds through E2B's template routes, driven by the real e2b SDK's Template
builder against the session's node: steps run in a sandbox, the result is snapshotted
with its start command running, and sandboxes of the template restore that snapshot."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException

from agentenv.testing import Node

SERVER = """\
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{os.environ['GREETING']} pid={os.getpid()}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def _name(kind: str) -> str:
    return f"xbt-{kind}-{uuid.uuid4().hex[:6]}"


def _build_sandboxes(api: httpx.Client) -> list[str]:
    return [s["sandboxID"] for s in api.get("/sandboxes").json()
            if "aenv.build" in (s.get("metadata") or {})]


def _wait_done(api: httpx.Client, template_id: str, build_id: str, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = api.get(f"/templates/{template_id}/builds/{build_id}/status").json()
        if status["status"] in ("ready", "error"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"build {build_id} did not finish")


def _proxied(node: Node, sandbox_id: str, port: int) -> httpx.Response:
    return httpx.get(node.url + "/", headers={"E2b-Sandbox-Id": sandbox_id,
                                              "E2b-Sandbox-Port": str(port)}, timeout=10)


def test_sdk_builds_a_template_that_sandboxes_start_from(
    node: Node, api: httpx.Client, tmp_path: Path
) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "app" / "static").mkdir(parents=True)
    (ctx / "app" / "server.py").write_text(SERVER)
    (ctx / "app" / "static" / "page.html").write_text("<p>static</p>\n")
    (ctx / "notes.txt").write_text("some notes\n")
    (ctx / "tools").mkdir()
    (ctx / "tools" / "hello-tool").write_text("#!/bin/sh\necho tool says $GREETING\n")
    name = _name("sdk")

    def template(greeting: str):
        return (Template(file_context_path=str(ctx)).from_template("base")
                .run_cmd("echo build-step-as-$(whoami)")
                .copy("app", "/home/user/app/")
                .copy("notes.txt", "/opt/notes.txt", mode=0o640)
                .copy("tools", "/opt/tools/", mode=0o755)
                # As in Docker, $PATH is the PATH before this step.
                .set_envs({"GREETING": greeting, "PATH": "/opt/tools:$PATH"})
                .set_workdir("/home/user/app")
                .run_cmd("echo $GREETING > greeting.txt && hello-tool")
                .set_start_cmd("python3 server.py", wait_for_port(8000)))

    logs: list = []
    info = Template.build(template("hello-one"), name, on_build_logs=logs.append)
    messages = [e.message for e in logs]
    # The build's log streamed: the step header, the command's own output, the end.
    assert "[1/7] RUN echo build-step-as-$(whoami)" in messages, messages
    assert "build-step-as-user" in messages and "tool says hello-one" in messages
    assert any("is ready" in m for m in messages)
    assert not _build_sandboxes(api)

    sb = Sandbox.create(name)
    try:
        assert sb.get_info().template_id == info.template_id
        assert "aenv.build" not in (sb.get_info().metadata or {})  # the build's, not its own
        # The start command's server was running in the snapshot: it answers at once.
        first = _proxied(node, sb.sandbox_id, 8000)
        assert first.status_code == 200 and first.text.startswith("hello-one pid=")
        out = sb.commands.run("whoami; pwd; echo $GREETING; cat greeting.txt static/page.html; "
                              "stat -c '%U %a' /opt/notes.txt app 2>/dev/null; "
                              "stat -c '%U' /home/user/app/server.py; cat /opt/notes.txt").stdout
        assert out.split("\n")[:5] == ["user", "/home/user/app", "hello-one", "hello-one",
                                       "<p>static</p>"], out
        assert "user 640" in out and "some notes" in out
        path = sb.commands.run("hello-tool; echo $PATH").stdout.split("\n")
        assert path[0] == "tool says hello-one" and path[1].startswith("/opt/tools:/usr/"), path
        # Envs given at create add to the template's.
        other = Sandbox.create(name, envs={"EXTRA": "x"})
        try:
            assert other.commands.run("echo $GREETING $EXTRA").stdout.strip() == "hello-one x"
        finally:
            other.kill()

        listed = {t["templateID"]: t for t in api.get("/templates").json()}
        assert listed[info.template_id]["aliases"] == [name]
        assert api.get(f"/templates/aliases/{name}").json()["templateID"] == info.template_id
        first_snapshot = _snapshot_of(node, info.template_id)

        # Deleting a template sandboxes run from is refused, clearly.
        r = api.delete(f"/templates/{name}")
        assert r.status_code == 409 and sb.sandbox_id in r.json()["message"]
    finally:
        sb.kill()

    # A rebuild keeps the template ID, publishes a new build, and drops the old snapshot.
    again = Template.build(template("hello-two"), name)
    assert again.template_id == info.template_id and again.build_id != info.build_id
    assert _snapshot_of(node, info.template_id) != first_snapshot
    assert api.get(f"/snapshots/{first_snapshot}").status_code == 404
    sb = Sandbox.create(info.template_id)
    try:
        assert _proxied(node, sb.sandbox_id, 8000).text.startswith("hello-two pid=")
    finally:
        sb.kill()

    # A template built on the built one starts from all it holds, service included.
    child = Template.build(Template().from_template(name).run_cmd("cat greeting.txt"),
                           f"{name}-child")
    sb = Sandbox.create(f"{name}-child")
    try:
        assert sb.commands.run("cat greeting.txt; echo $GREETING").stdout == \
            "hello-two\nhello-two\n"
        assert _proxied(node, sb.sandbox_id, 8000).text.startswith("hello-two pid=")
    finally:
        sb.kill()
    assert api.delete(f"/templates/{child.template_id}").status_code == 204

    snapshot = _snapshot_of(node, info.template_id)
    assert api.delete(f"/templates/{name}").status_code == 204
    assert api.get(f"/templates/{info.template_id}").status_code == 404
    assert api.get(f"/snapshots/{snapshot}").status_code == 404
    assert not (node.home / "templates" / info.template_id).exists()
    r = api.post("/sandboxes", json={"templateID": name})
    assert r.status_code == 404, r.text
    assert api.delete(f"/templates/{name}").status_code == 404


def _snapshot_of(node: Node, template_id: str) -> str:
    import json

    return json.loads((node.home / "templates" / template_id / "template.json")
                      .read_text())["snapshotID"]


def test_failing_step_fails_the_build_with_its_output(api: httpx.Client) -> None:
    name = _name("fail")
    tpl = (Template().from_template("base")
           .run_cmd("echo fine")
           .run_cmd("echo about-to-fail; echo oops-on-stderr >&2; exit 3"))
    with pytest.raises(BuildException) as failure:
        Template.build(tpl, name)
    message = str(failure.value)
    assert "step 2 (RUN) failed with exit code 3" in message
    assert "about-to-fail" in message and "oops-on-stderr" in message

    info = Template.build_in_background(tpl, name)
    status = _wait_done(api, info.template_id, info.build_id)
    assert status["status"] == "error"
    assert status["reason"]["step"] == "2"
    assert any("oops-on-stderr" in e["message"] for e in status["reason"]["logEntries"])
    # Nothing was published, and the build sandboxes are gone.
    assert api.get(f"/templates/{name}").status_code == 404
    assert not _build_sandboxes(api)
    assert api.delete(f"/templates/{info.template_id}").status_code == 204
    assert api.get(f"/templates/{info.template_id}/builds/{info.build_id}/status"
                   ).status_code == 404


def test_build_routes_refuse_bad_requests(node: Node, api: httpx.Client) -> None:
    def error(r: httpx.Response, code: int) -> str:
        assert r.status_code == code, r.text
        assert r.json()["code"] == code
        return r.json()["message"]

    assert "invalid template name" in error(api.post("/v3/templates",
                                                     json={"name": "Bad Name!"}), 400)
    assert "built-in" in error(api.post("/v3/templates", json={"name": "base"}), 409)
    assert "built-in" in error(api.delete("/templates/base"), 403)
    digest = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    error(api.get(f"/templates/nosuchtemplate/files/{digest}"), 404)

    created = api.post("/v3/templates", json={"name": _name("routes"), "cpuCount": 1})
    assert created.status_code == 202, created.text
    tid, bid = created.json()["templateID"], created.json()["buildID"]
    error(api.get(f"/templates/{tid}/files/not-a-hash"), 400)
    link = api.get(f"/templates/{tid}/files/{digest}")
    assert link.status_code == 201 and link.json()["present"] is False
    url = link.json()["url"]
    # The upload URL is signed: no API key needed, but a changed one is refused.
    assert error(httpx.put(url.replace("signature=", "signature=0"), content=b"x"), 403)
    assert error(httpx.put(url.replace(digest, "0" * 64), content=b"x"), 403)
    assert httpx.put(url, content=b"not really a tar").status_code == 201
    assert api.get(f"/templates/{tid}/files/{digest}").json() == {"present": True}

    start = f"/v2/templates/{tid}/builds/{bid}"
    assert "ADD" in error(api.post(start, json={"fromTemplate": "base",
                                                "steps": [{"type": "ADD", "args": ["a"]}]}), 400)
    assert "exactly one" in error(api.post(start, json={"steps": []}), 400)
    assert "not uploaded" in error(api.post(start, json={
        "fromTemplate": "base",
        "steps": [{"type": "COPY", "args": ["x", "/x"], "filesHash": "f" * 64}]}), 400)
    error(api.get(f"/templates/{tid}/builds/{uuid.uuid4()}/status"), 404)

    # A long build is cancelled; its sandbox goes with it.
    r = api.post(start, json={"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["echo started; sleep 120"]}]})
    assert r.status_code == 202, r.text
    error(api.post(start, json={"fromTemplate": "base", "steps": []}), 409)
    end = time.monotonic() + 60
    while not any(e["message"] == "started" for e in
                  api.get(f"/templates/{tid}/builds/{bid}/status").json()["logEntries"]):
        assert time.monotonic() < end
        time.sleep(0.2)
    assert api.delete(f"/templates/{tid}/builds/{bid}").status_code == 204
    status = _wait_done(api, tid, bid, timeout=30)
    assert status["status"] == "error" and "cancelled" in status["reason"]["message"]
    assert not _build_sandboxes(api)

    # Logs: paged by offset in the status; by time and direction in /logs.
    all_logs = api.get(f"/templates/{tid}/builds/{bid}/status").json()["logEntries"]
    assert len(all_logs) >= 3
    page = api.get(f"/templates/{tid}/builds/{bid}/status",
                   params={"logsOffset": 1, "limit": 1}).json()["logEntries"]
    assert page == all_logs[1:2]
    errors = api.get(f"/templates/{tid}/builds/{bid}/logs", params={"level": "error"}).json()
    assert [e["level"] for e in errors["logs"]] == ["error"]
    backward = api.get(f"/templates/{tid}/builds/{bid}/logs",
                       params={"direction": "backward"}).json()["logs"]
    assert backward == all_logs[::-1]
    assert api.delete(f"/templates/{tid}").status_code == 204
    assert httpx.get(node.url + "/health").status_code == 200


def test_sdk_template_tags(node: Node, api: httpx.Client) -> None:
    """E2B's tags through the SDK's Template.assign_tags / get_tags / remove_tags: a
    tag names one build; ``name`` is ``name:default``, the latest build unless a build
    names its own tags; ``name:tag`` works for creates and as a build's base; a build
    no tag names any more loses its snapshot; bad tags are 400s."""
    from e2b import SandboxException
    from e2b.exceptions import TemplateException

    name = _name("tags")

    def version(text: str):
        return Template().from_template("base").run_cmd(f"echo {text} > /home/user/v.txt")

    def read(ref: str) -> str:
        sb = Sandbox.create(ref, timeout=120)
        try:
            return sb.commands.run("cat /home/user/v.txt").stdout.strip()
        finally:
            sb.kill()

    def tags() -> dict[str, str]:
        return {t.tag: t.build_id for t in Template.get_tags(name)}

    one = Template.build(version("one"), name)
    assert tags() == {"default": one.build_id}
    assigned = Template.assign_tags(f"{name}:default", "V1 ")  # E2B normalises case
    assert assigned.tags == ["v1"] and assigned.build_id == one.build_id
    first_snapshot = _snapshot_of(node, one.template_id)
    two = Template.build(version("two"), name)
    assert tags() == {"default": two.build_id, "v1": one.build_id}
    assert [read(ref) for ref in (name, f"{name}:default", f"{name}:v1",
                                  f"{one.template_id}:v1")] == ["two", "two", "one", "one"]
    # the tagged build keeps its snapshot; a build from name:tag starts from that build
    repo_snapshots = node.home / "snapshots" / "manifests"
    assert (repo_snapshots / f"{first_snapshot}.json").exists()
    child = Template.build(Template().from_template(f"{name}:v1")
                           .run_cmd("cp /home/user/v.txt /home/user/base.txt"), f"{name}-kid")
    sb = Sandbox.create(f"{name}-kid", timeout=120)
    try:
        assert sb.commands.run("cat /home/user/base.txt").stdout.strip() == "one"
    finally:
        sb.kill()
    assert api.delete(f"/templates/{child.template_id}").status_code == 204

    # a build naming its own tags leaves default where it was
    three = Template.build(version("three"), f"{name}:v3")
    assert tags() == {"default": two.build_id, "v1": one.build_id, "v3": three.build_id}
    assert read(name) == "two" and read(f"{name}:v3") == "three"

    # move v1 to the current build: the first build is named by no tag and goes
    moved = Template.assign_tags(name, ["v1"])
    assert moved.build_id == two.build_id
    assert tags() == {"default": two.build_id, "v1": two.build_id, "v3": three.build_id}
    assert read(f"{name}:v1") == "two"
    assert not (repo_snapshots / f"{first_snapshot}.json").exists()

    # delete a tag: creating by it is a clear 404, the build it named is gone
    Template.remove_tags(name, "v3")
    assert tags() == {"default": two.build_id, "v1": two.build_id}
    with pytest.raises(SandboxException, match="no tag 'v3'") as gone:
        Sandbox.create(f"{name}:v3", timeout=60)
    assert getattr(gone.value, "status_code", 404) == 404
    r = api.post("/sandboxes", json={"templateID": f"{name}:v3"})
    assert r.status_code == 404 and "v3" in r.json()["message"]

    # bad input: 400s naming the rule; unknown template or tag: 404
    for bad in (["bad tag!"], ["-x"], ["x" * 65], [], [str(uuid.uuid4())]):
        with pytest.raises(TemplateException, match=r"^400"):
            Template.assign_tags(name, bad)
    with pytest.raises(TemplateException, match=r"^400.*default"):
        Template.remove_tags(name, "default")
    with pytest.raises(TemplateException, match=r"^400"):
        Template.remove_tags(f"{name}:v1", "v1")
    with pytest.raises(TemplateException, match=r"^404"):
        Template.assign_tags(f"{name}:nope", "x")
    with pytest.raises(TemplateException, match=r"^404"):
        Template.get_tags("xbt-no-such-template")
    r = api.post("/sandboxes", json={"templateID": f"{name}:Bad Tag!"})
    assert r.status_code == 400 and "tag" in r.json()["message"], r.text
    r = api.post("/templates/tags", json={"target": name, "tags": ["t"] * 33})
    assert r.status_code == 400
    r = api.post("/templates/tags", json={"target": name,
                                          "tags": [f"t{i}" for i in range(31)]})
    assert r.status_code == 400 and "at most" in r.json()["message"], r.text
    assert set(tags()) == {"default", "v1"}
    # built-in templates take tags too
    Template.assign_tags("base", "stable")
    try:
        sb = Sandbox.create("base:stable", timeout=60)
        try:
            assert sb.get_info().template_id == "base"
        finally:
            sb.kill()
        assert {t.tag for t in Template.get_tags("base")} == {"default", "stable"}
    finally:
        Template.remove_tags("base", "stable")

    # deleting the template (a tag in its name is ignored, as E2B) takes every build
    kept = _snapshot_of(node, two.template_id)
    assert api.delete(f"/templates/{name}:v1").status_code == 204
    assert not (repo_snapshots / f"{kept}.json").exists()
    assert not (node.home / "templates" / ".tags" / f"{two.template_id}.json").exists()
    assert api.post("/sandboxes", json={"templateID": f"{name}:v1"}).status_code == 404
