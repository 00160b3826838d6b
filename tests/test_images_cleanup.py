"""The templates creates from images make by themselves (img-..., setup-...) are removed
once unused for image_template_idle_s (here a few seconds), on a real lazily loading
node through the e2b SDK: never while a sandbox or a user's snapshot needs them, nor a
user's own named template; gone with their boot image or setup snapshot and their
layers' FUSE mounts; a later create makes them again; a restart finishes a removal a
crash interrupted. Deleting an image template (DELETE /templates/{id}, as DELETE
/images/{name}) also unmounts its lazy layers."""

from __future__ import annotations

import json
import os
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.builds.base import image_template_name
from agentenv.config import ConfigError, load_config
from agentenv.images.mounts import mounted_under
from agentenv.testing import Node, free_cidr, leaks, sdk_env
from agentenv.testing.oci_registry import (
    DEFAULT_PATH,
    Entry,
    RegistryServer,
    build_image,
    tar_layer,
)
from agentenv.testing.small_images import tools_layer

PREFIX = f"y{os.getpid() % 4096:03x}"
CIDR = free_cidr(180, 10, os.getpid())  # 10.180-10.189: this file's band
IDLE_S = 2


def wait_for(what: Callable[[], bool], timeout: float = 45) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("images-cleanup")
    registry = RegistryServer(tmp / "registry").start()
    try:
        tools = tools_layer()
        refs = {}
        for name in ("auto", "setup", "named"):
            top = tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                             Entry("opt/marker", f"{name}\n".encode())])
            refs[name] = registry.push(f"clean/{name}", "v1", build_image(
                [tools, top], env=[f"PATH={DEFAULT_PATH}"]))
        node = Node(tmp / "home", PREFIX, CIDR, AENV_IMAGE_LOADING="lazy",
                    AENV_IMAGE_TEMPLATE_IDLE_S=str(IDLE_S))
        node.start()
        try:
            with sdk_env(node.e2b_env()), node.client() as api:
                yield {"node": node, "api": api, "refs": refs}
        finally:
            node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def template_dir(node: Node, name: str) -> Path:
    return node.home / "templates" / name


def lazy_mounts(node: Node) -> set[str]:
    return {p.name for p in mounted_under(node.home / "cache" / "images" / "lazy" / "mnt")}


def top_layer(node: Node, name: str) -> str:
    """The hex of the image template's top layer (its lazy mount's name)."""
    doc = json.loads((template_dir(node, name) / "template.json").read_text())
    return str(doc["image"]["layers"][-1]["digest"]).split(":")[1]


def aliases(node: Node, prefix: str) -> list[str]:
    return [p.name for p in (node.home / "snapshots" / "aliases").glob(prefix + "*")]


def manifest(node: Node, snapshot_id: str) -> Path:
    return node.home / "snapshots" / "manifests" / f"{snapshot_id}.json"


def test_unused_image_template_removed_then_made_again(world: dict) -> None:
    node, api, ref = world["node"], world["api"], world["refs"]["auto"]
    name = image_template_name(ref)
    # A user's named image template, unused from here on: never removed.
    r = api.post("/images", json={"image": world["refs"]["named"], "name": "mine"},
                 timeout=300)
    assert r.status_code in (200, 201), r.text
    mine = top_layer(node, "mine")
    Sandbox.create(template="mine", timeout=60).kill()
    sbx = Sandbox.create(template=f"docker://{ref}", timeout=120)
    try:
        assert sbx.commands.run("cat /opt/marker").stdout == "auto\n"
        top = top_layer(node, name)
        # Its boot image is built in the background after the first create.
        wait_for(lambda: bool(aliases(node, f"tpl.{name}.")))
        boot = (node.home / "snapshots" / "aliases" / aliases(node, f"tpl.{name}.")[0]
                ).read_text().strip()
        time.sleep(IDLE_S * 2)  # a running sandbox keeps it
        assert (template_dir(node, name) / "template.json").exists()
        assert top in lazy_mounts(node)
    finally:
        sbx.kill()
    wait_for(lambda: f"templates: {name} removed" in node.log_path.read_text())
    assert not template_dir(node, name).exists()
    assert aliases(node, f"tpl.{name}.") == [] and not manifest(node, boot).exists()
    assert top not in lazy_mounts(node)
    assert (template_dir(node, "mine") / "template.json").exists()  # a user's: never
    # Deleting an image template (E2B's route) unmounts its lazy layers no other
    # template uses.
    assert mine in lazy_mounts(node)
    assert api.delete("/templates/mine").status_code == 204
    assert mine not in lazy_mounts(node)
    assert api.get("/templates/mine").status_code == 404
    # A later create pulls it again.
    sbx = Sandbox.create(template=f"docker://{ref}", timeout=120)
    try:
        assert sbx.get_info().template_id == name
        assert sbx.commands.run("cat /opt/marker").stdout == "auto\n"
    finally:
        sbx.kill()


def test_setup_kept_while_needed_and_a_restart_finishes_its_removal(world: dict) -> None:
    node, api, ref = world["node"], world["api"], world["refs"]["setup"]
    r = api.post("/sandboxes", json={"image": ref, "imageSetup": "echo done > /opt/setup",
                                     "timeout": 120}, timeout=300)
    assert r.status_code == 201, r.text
    setup, image = r.json()["templateID"], image_template_name(ref)
    assert setup.startswith("setup-")
    top = top_layer(node, image)
    built = json.loads((template_dir(node, setup) / "template.json").read_text())["snapshotID"]
    sbx = Sandbox.connect(r.json()["sandboxID"])
    assert sbx.commands.run("cat /opt/setup").stdout == "done\n"
    snap = sbx.create_snapshot()
    sbx.kill()
    # The user's snapshot restores over the setup template; the setup needs the image.
    time.sleep(IDLE_S * 2)
    assert (template_dir(node, setup) / "template.json").exists()
    assert (template_dir(node, image) / "template.json").exists()
    # The node dies right after a removal of the setup template dropped its record
    # (what TemplateCleanup._unlink leaves); the restart finishes the removal.
    node.kill9()
    (template_dir(node, setup) / ".removing").write_text(json.dumps({"snapshots": [built]}))
    (template_dir(node, setup) / "template.json").unlink()
    node.start()
    assert not template_dir(node, setup).exists() and not manifest(node, built).exists()
    assert "finishing the removal" in node.log_path.read_text()
    # Once the user's snapshot goes, nothing needs the image.
    Sandbox.delete_snapshot(snap.snapshot_id)
    wait_for(lambda: not template_dir(node, image).exists())
    assert top not in lazy_mounts(node)
    assert api.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_bad_idle_setting_is_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="image_template_idle_s"):
        load_config({"home": tmp_path, "image_template_idle_s": value})
    assert load_config({"home": tmp_path}).image_template_idle_s == 86400  # 24 h
    assert load_config({"home": tmp_path, "image_template_idle_s": "0"}).image_template_idle_s \
        == 0  # never
