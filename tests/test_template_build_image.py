"""A template built from an OCI image (fromImage) pulled from a real registry on loopback."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template

from agentenv.testing import Node
from agentenv.testing.oci_registry import DEFAULT_PATH, RegistryServer, build_image
from agentenv.testing.small_images import tools_layer


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    with RegistryServer(tmp_path_factory.mktemp("registry")) as server:
        yield server


def test_build_from_an_image(node: Node, api: httpx.Client, registry: RegistryServer,
                             tmp_path: Path) -> None:
    image = build_image([tools_layer()], env=[f"PATH={DEFAULT_PATH}", "FROM_IMAGE=yes"],
                        cmd=["/bin/bash"])
    ref = registry.push(f"xbt/small-{uuid.uuid4().hex[:6]}", "v1", image)
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    name = f"xbt-image-{uuid.uuid4().hex[:6]}"
    tpl = (Template(file_context_path=str(tmp_path)).from_image(ref)
           .run_cmd("echo \"$FROM_IMAGE as $(id -un)\" > /opt/marker")
           .copy("hello.txt", "/opt/hello.txt"))
    logs: list = []
    info = Template.build(tpl, name, on_build_logs=logs.append)
    assert any(f"Pulling {ref}" in e.message for e in logs)

    meta = json.loads((node.home / "templates" / info.template_id / "template.json").read_text())
    # The built template sits on the image's layers, not on a copy of them.
    assert meta["image"]["manifestDigest"] == image.manifest.digest and "rootfs" not in meta
    sb = Sandbox.create(name)
    try:
        out = sb.commands.run("cat /opt/marker /opt/hello.txt; echo $FROM_IMAGE; "
                              "test -e /usr/bin/python3 || echo no-python").stdout
        assert out.split("\n")[:4] == ["yes as root", "hello from the context", "yes",
                                       "no-python"], out
    finally:
        sb.kill()

    # A second build reuses the pulled image.
    logs.clear()
    Template.build(tpl, name, on_build_logs=logs.append)
    assert any(f"Image {ref} is cached" in e.message for e in logs)
    assert api.delete(f"/templates/{name}").status_code == 204

    # An image that is not there fails the build at its base step, clearly.
    missing = Template().from_image(f"{registry.host}/xbt/nothing-here:v1")
    info = Template.build_in_background(missing, f"xbt-noimage-{uuid.uuid4().hex[:6]}")
    end = time.monotonic() + 120
    while (status := api.get(f"/templates/{info.template_id}/builds/{info.build_id}/status"
                             ).json())["status"] not in ("ready", "error"):
        assert time.monotonic() < end
        time.sleep(0.2)
    assert status["status"] == "error" and status["reason"]["step"] == "base"
    assert "pulling image" in status["reason"]["message"]


def test_build_from_an_image_without_mount_points(registry: RegistryServer) -> None:
    image = build_image([tools_layer(mountpoint=False)], env=[f"PATH={DEFAULT_PATH}"])
    ref = registry.push(f"xbt/plain-{uuid.uuid4().hex[:6]}", "v1", image)
    tpl = Template().from_image(ref).run_cmd("true")
    Template.build(tpl, f"xbt-plain-{uuid.uuid4().hex[:6]}")
