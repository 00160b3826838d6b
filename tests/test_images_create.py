"""Creates straight from an image reference on the session's node: the `image` field,
the e2b SDKs' `template="docker://REF"`, `aenv start --image`; concurrent first
creates share one pull; `imageSetup` runs once per (image digest, command) and
later creates restore its snapshot."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxException

from agentenv.testing import Node
from agentenv.testing.nodes import AENV
from agentenv.testing.oci_registry import (
    DEFAULT_PATH,
    Entry,
    RegistryServer,
    build_image,
    tar_layer,
)
from agentenv.testing.small_images import tools_layer

JS = Path(__file__).resolve().parent / "js"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    with RegistryServer(tmp_path_factory.mktemp("registry")) as server:
        yield server


@pytest.fixture(scope="module")
def tools() -> bytes:
    return tools_layer()


def push(registry: RegistryServer, tools: bytes, marker: str) -> str:
    """A small image (tools + /opt/marker) under a repository of its own."""
    top = tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                     Entry("opt/marker", f"{marker}\n".encode())])
    image = build_image([tools, top], env=[f"PATH={DEFAULT_PATH}", f"MARKER={marker}"])
    return registry.push(f"xic/{marker}", "v1", image)


def pulls_logged(node: Node, ref: str) -> int:
    return len(re.findall(rf"images: {re.escape(ref)} pulled as template",
                          node.log_path.read_text()))


def test_create_from_image_http_sdk_and_cli(node: Node, api: httpx.Client,
                                            registry: RegistryServer, tools: bytes) -> None:
    marker = f"m{uuid.uuid4().hex[:8]}"
    ref = push(registry, tools, marker)
    sandboxes: list[str] = []
    try:
        # Three first creates at once (two by the field, one by the SDK's template
        # name): one pull, one template.
        def by_field() -> dict:
            r = api.post("/sandboxes", json={"image": ref, "timeout": 120}, timeout=300)
            assert r.status_code == 201, r.text
            return r.json()

        def by_sdk() -> Sandbox:
            return Sandbox.create(template=f"docker://{ref}", timeout=120)

        with ThreadPoolExecutor(3) as pool:
            fields = [pool.submit(by_field) for _ in range(2)]
            sdk = pool.submit(by_sdk)
            created = [f.result() for f in fields]
            sbx = sdk.result()
        sandboxes += [c["sandboxID"] for c in created] + [sbx.sandbox_id]
        template_ids = {c["templateID"] for c in created} | {sbx.get_info().template_id}
        assert len(template_ids) == 1 and template_ids.pop().startswith("img-")
        assert pulls_logged(node, ref) == 1
        out = sbx.commands.run("cat /opt/marker; echo $MARKER")
        assert out.stdout.split() == [marker, marker]
        for sid in sandboxes[:2]:
            other = Sandbox.connect(sid)
            assert other.commands.run("cat /opt/marker").stdout.strip() == marker
        # Later creates use the template: no pull.
        sandboxes.append(Sandbox.create(template=f"docker://{ref}", timeout=60).sandbox_id)
        assert pulls_logged(node, ref) == 1
        # The CLI.
        env = {**os.environ, "AENV_API_URL": node.url, "AENV_API_KEY": node.api_key}
        r = subprocess.run([str(AENV), "start", "--image", ref, "-d", "--timeout", "60"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        sandboxes.append(r.stdout.strip())
        assert api.get(f"/sandboxes/{sandboxes[-1]}").json()["state"] == "running"
        r = subprocess.run([str(AENV), "start", "base", "--image", ref, "-d"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "not both" in r.stderr
    finally:
        for sid in sandboxes:
            api.delete(f"/sandboxes/{sid}")


def test_create_from_image_js_sdk(node: Node, registry: RegistryServer, tools: bytes) -> None:
    node_bin = shutil.which("node")
    assert node_bin and (JS / "node_modules" / "e2b").is_dir(), "node and tests/js needed"
    ref = push(registry, tools, f"j{uuid.uuid4().hex[:8]}")
    env = {**os.environ, **node.e2b_env(), "AENV_TEST_IMAGE_REF": ref, "NODE_NO_WARNINGS": "1"}
    proc = subprocess.run([node_bin, "--test", "--test-reporter=spec", "image.test.mjs"],
                          cwd=JS, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    assert re.search(r"skipped 0\b", proc.stdout) and re.search(r"pass 1\b", proc.stdout), \
        proc.stdout[-2000:]


def test_create_from_image_bad_input(node: Node, api: httpx.Client,
                                     registry: RegistryServer) -> None:
    cases = [
        ({"image": ""}, 400, "empty"),
        ({"image": "Not A Reference"}, 400, "bad"),
        ({"image": "x" * 1025}, 400, ""),
        ({"image": f"{registry.host}/xic/missing:v1"}, 404, ""),
        ({"image": "oci-layout:/etc"}, 400, "image_import_dir"),
        ({"image": f"{registry.host}/xic/a:v1", "templateID": "base"}, 400, "one of"),
        ({"templateID": "base", "imageSetup": "true"}, 400, "go with image"),
        ({"image": f"{registry.host}/xic/a:v1", "imageSetup": "x" * 20000}, 400, ""),
        ({"image": f"{registry.host}/xic/a:v1",
          "imageCredentials": {"username": "u", "password": "p" * 9000}}, 400, ""),
        ({}, 400, "required"),
        ({"templateID": "docker://bad ref"}, 400, "bad"),
    ]
    for body, status, words in cases:
        r = api.post("/sandboxes", json=body, timeout=120)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"code", "message"} and r.json()["code"] == status
        assert words in r.json()["message"], (body, r.text)
    with pytest.raises(SandboxException):
        Sandbox.create(template=f"docker://{registry.host}/xic/nothing-here:v1", timeout=30)
    # The names creates from images use are theirs: no pull or build may take one
    # (it would swap the image under them).
    r = api.post("/images", json={"image": f"{registry.host}/xic/a:v1",
                                  "name": "img-0123456789abcdef"})
    assert r.status_code == 400 and "kept for creates" in r.json()["message"], r.text
    r = api.post("/v3/templates", json={"name": "setup-0123456789abcdef-0123456789abcdef:t1"})
    assert r.status_code == 400 and "kept for creates" in r.json()["message"], r.text
    # Nothing was made of them, and the node still serves.
    names = {t["templateID"] for t in api.get("/templates").json()}
    assert api.get("/health").json()["status"] == "ok"
    listed = api.get("/images").json()["images"]
    assert not any("missing" in i["image"] or "nothing-here" in i["image"] for i in listed)
    assert all(not n.startswith("img-") or n in {i["templateID"] for i in listed}
               for n in names)


def test_setup_runs_once_per_image_and_command(node: Node, api: httpx.Client,
                                               registry: RegistryServer, tools: bytes) -> None:
    marker = f"s{uuid.uuid4().hex[:8]}"
    ref = push(registry, tools, marker)
    # What the setup leaves is unique to its run: one run means one value everywhere.
    setup = "echo $RANDOM$RANDOM$RANDOM$RANDOM > /opt/ran-once"
    sandboxes: list[str] = []

    def create(command: str) -> dict:
        r = api.post("/sandboxes", json={"image": ref, "imageSetup": command, "timeout": 120},
                     timeout=300)
        assert r.status_code == 201, r.text
        sandboxes.append(r.json()["sandboxID"])
        return r.json()

    def ran_once(sid: str) -> str:
        return Sandbox.connect(sid).commands.run("cat /opt/ran-once; cat /opt/marker").stdout

    try:
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(create, [setup, setup]))
        assert {c["templateID"] for c in first} == {first[0]["templateID"]}
        assert first[0]["alias"].startswith("setup-"), first[0]
        values = {ran_once(c["sandboxID"]) for c in first}
        assert len(values) == 1 and values.pop().endswith(f"{marker}\n")
        again = create(setup)
        assert again["templateID"] == first[0]["templateID"]
        assert ran_once(again["sandboxID"]) == ran_once(first[0]["sandboxID"])
        # Another command is another pair: its own run, over the same image.
        other = create(setup + " # v2")
        assert other["templateID"] != first[0]["templateID"]
        assert ran_once(other["sandboxID"]) != ran_once(first[0]["sandboxID"])
        # A failing setup is the create's clear error; nothing is kept of it.
        r = api.post("/sandboxes", json={"image": ref, "imageSetup": "echo broken >&2; exit 3"},
                     timeout=300)
        assert r.status_code == 400 and "image setup failed" in r.json()["message"], r.text
        assert "broken" in r.json()["message"]
        assert api.get("/health").json()["status"] == "ok"
    finally:
        for sid in sandboxes:
            api.delete(f"/sandboxes/{sid}")
