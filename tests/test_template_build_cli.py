"""`aenv template build | ls | rm` as subprocesses against the session's node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import httpx
import pytest

from agentenv.testing import Node

CLI = [sys.executable, "-m", "agentenv.cli.main"]


@pytest.fixture(scope="module")
def env(node: Node, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("AENV_", "E2B_", "XDG_CONFIG_HOME"))}
    out.update(AENV_CONFIG_DIR=str(tmp_path_factory.mktemp("aenv-config")),
               AENV_API_URL=node.url, AENV_API_KEY=node.api_key, COLUMNS="200")
    return out


def aenv(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300,
                       start_new_session=True)
    if ok:
        assert r.returncode == 0, f"aenv {' '.join(args)} -> {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("aenv: ") and "Traceback" not in r.stderr, r.stderr
    return lines[-1]


def test_build_ls_rm_from_a_dockerfile(node: Node, env: dict[str, str], tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "site").mkdir(parents=True)
    (ctx / "site" / "index.html").write_text("<h1>from the dockerfile</h1>\n")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM e2bdev/base\nENV MODE=cli-built\nCOPY site /srv/site\n"
                          "WORKDIR /srv/site\nRUN echo \"mode is $MODE\" | tee built.txt\n")
    name = f"xbt-cli-{uuid.uuid4().hex[:6]}"
    r = aenv(env, "template", "build", "-f", str(dockerfile), "--context", str(ctx),
             "--name", name)
    template_id = r.stdout.strip()
    assert template_id and "\n" not in template_id
    # The build's log streamed to stderr, the command's own output included.
    assert "COPY site /srv/site" in r.stderr and "mode is cli-built" in r.stderr

    listed = aenv(env, "template", "ls").stdout
    assert "TEMPLATE ID" in listed and template_id in listed and name in listed
    as_json = json.loads(aenv(env, "template", "ls", "--json").stdout)
    assert name in next(t for t in as_json if t["templateID"] == template_id)["aliases"]

    with node.client() as api:
        r = api.post("/sandboxes", json={"templateID": name})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            out = aenv(env, "exec", sid, "--", "sh", "-c",
                       "pwd; echo $MODE; cat built.txt index.html").stdout
            assert out.split("\n")[:4] == ["/srv/site", "cli-built", "mode is cli-built",
                                           "<h1>from the dockerfile</h1>"], out
            assert "kill them first" in one_line_error(aenv(env, "template", "rm", name,
                                                            ok=False))
        finally:
            api.delete(f"/sandboxes/{sid}")

    # FROM a template of the node, as docker uses a local image before pulling.
    child = tmp_path / "Dockerfile.child"
    child.write_text(f"FROM {name}\nRUN cat /srv/site/built.txt\n")
    r = aenv(env, "template", "build", "-f", str(child), "--name", f"{name}-child")
    assert "mode is cli-built" in r.stderr, r.stderr
    assert aenv(env, "template", "rm", f"{name}-child").stdout.strip() == f"{name}-child"

    assert aenv(env, "template", "rm", name).stdout.strip() == name
    assert template_id not in aenv(env, "template", "ls").stdout
    assert "not found" in one_line_error(aenv(env, "template", "rm", name, ok=False))
    assert httpx.get(node.url + "/health").status_code == 200


def test_build_errors_are_one_line(env: dict[str, str], tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM e2bdev/base\nRUN echo doomed && exit 7\n")
    r = aenv(env, "template", "build", "-f", str(dockerfile), "--name",
             f"xbt-clifail-{uuid.uuid4().hex[:6]}", ok=False)
    line = one_line_error(r)
    assert "build failed" in line and "exit code 7" in line
    assert "doomed" in r.stderr and r.stdout == ""

    r = aenv(env, "template", "build", "-f", str(dockerfile), "--name", "Not Valid", ok=False)
    assert "invalid template name" in one_line_error(r)
    r = aenv(env, "template", "build", "-f", str(tmp_path / "missing"), ok=False)
    assert r.returncode == 2  # usage error from the option check


def test_the_readmes_offline_quick_start(node: Node, env: dict[str, str],
                                         tmp_path: Path) -> None:
    """README, quick start: with no registry, build on `base`, or pull an OCI layout
    from below the node's import dir."""
    from agentenv.testing.oci_registry import Entry, build_image, tar_layer, write_oci_layout

    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM base\nWORKDIR /srv\nRUN echo hello > index.html\n"
                          "CMD python3 -m http.server 8000\n")  # the README's, word for word
    name = f"xbt-offline-{uuid.uuid4().hex[:6]}"
    aenv(env, "template", "build", "-f", str(dockerfile), "--name", name)
    sid = aenv(env, "start", name, "--detach").stdout.strip()
    try:  # it starts with its server up (CMD), serving the file the build wrote
        out = aenv(env, "exec", sid, "--", "curl", "-s", "http://127.0.0.1:8000/index.html")
        assert out.stdout == "hello\n"
    finally:
        aenv(env, "rm", sid)
        aenv(env, "template", "rm", name)

    layout = node.home / "imports" / "py"
    image = build_image([tar_layer([Entry("srv/", type=tarfile.DIRTYPE, mode=0o755),
                                    Entry("srv/from-layout", b"offline")])], ["gzip"])
    write_oci_layout(layout, image, tag="3.12")
    pulled = f"xbt-layout-{uuid.uuid4().hex[:6]}"
    aenv(env, "pull", f"oci-layout:{layout}:3.12", "--name", pulled)
    try:
        assert pulled in aenv(env, "template", "ls").stdout
    finally:
        aenv(env, "template", "rm", pulled)


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal's foreground job gets it: a suite started in the background
    by a non-interactive shell (`.ci/run &`) runs with SIGINT ignored, every child
    inherits that, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_cancels_the_build(node: Node, env: dict[str, str], tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM e2bdev/base\nRUN echo long-step-started && sleep 300\n")
    proc = subprocess.Popen([*CLI, "template", "build", "-f", str(dockerfile), "--name",
                             f"xbt-clicancel-{uuid.uuid4().hex[:6]}"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_as_in_a_terminal)
    seen = ""
    assert proc.stderr is not None
    for line in proc.stderr:
        seen += line
        if "long-step-started" in line:
            break
    ids = re.search(r"Template created with ID: (\w+), Build ID: ([\w-]+)", seen)
    assert ids, seen
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 130, seen + rest
    assert "cancelling the build" in rest, rest
    with node.client() as api:
        status = api.get(f"/templates/{ids[1]}/builds/{ids[2]}/status").json()
        assert status["status"] == "error" and "cancelled" in status["reason"]["message"]
        assert not [s for s in api.get("/sandboxes").json()
                    if s.get("metadata", {}).get("aenv.build") == ids[2]]
