"""Incremental snapshots of REAL gVisor checkpoint images, both backends.

A small runsc sandbox (overlay root in memory, no network) holds 48 MiB of
random data in a Python process; it is checkpointed (leave-running, no
compression), 1 MiB is written to a file inside it, and it is checkpointed
again. The second snapshot must store at most 5% of what the first stored, and
both must come back byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_snapshot_store import (  # noqa: F401  (fixtures)
    fixture_backend,
    fixture_config,
    fixture_s3_server,
    make_store,
    read_tree,
)

ROOTFS = Path(os.environ.get("AENV_HOME", "/var/lib/aenv")) / "images/templates/base/rootfs"
RUNSC = shutil.which("runsc")

pytestmark = pytest.mark.skipif(
    RUNSC is None or os.geteuid() != 0 or not (ROOTFS / "usr/bin/python3").exists(),
    reason="needs root, runsc and the base template rootfs")

PROGRAM = ("import os, time\n"
           "keep = os.urandom(48 << 20)\n"
           "open('/tmp/ready', 'w').close()\n"
           "time.sleep(1e9)\n")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    work = tmp_path_factory.mktemp("runsc")
    root, bundle = work / "state", work / "bundle"
    root.mkdir()
    bundle.mkdir()
    cid = f"snaptest-{uuid.uuid4().hex[:8]}"
    runsc = [RUNSC, f"--root={root}", "--network=none", "--overlay2=root:memory"]
    subprocess.run([RUNSC, "spec", "--bundle", str(bundle), "--", "/usr/bin/python3", "-c",
                    PROGRAM], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(ROOTFS), "readonly": False}
    spec["process"]["terminal"] = False
    (bundle / "config.json").write_text(json.dumps(spec))

    log = work / "runsc.err"

    def run(*args: str, timeout: float = 30) -> None:
        # Never a pipe: a detached sandbox would keep it open for its whole life.
        with open(log, "ab") as err:
            code = subprocess.run([*runsc, *args], timeout=timeout, stdin=subprocess.DEVNULL,
                                  stdout=err, stderr=err).returncode
        assert code == 0, f"runsc {args[0]} failed: {log.read_text()[-2000:]}"

    try:
        run("run", "--detach", "--bundle", str(bundle), cid)
        run("exec", cid, "/bin/sh", "-c",
            "for i in $(seq 200); do [ -e /tmp/ready ] && exit 0; sleep 0.05; done; exit 1")
        first, second = work / "ck1", work / "ck2"
        run("checkpoint", "--image-path", str(first), "--leave-running", "--compression=none",
            cid)
        run("exec", cid, "/bin/sh", "-c", "head -c 1048576 /dev/urandom > /root/change.bin")
        run("checkpoint", "--image-path", str(second), "--leave-running", "--compression=none",
            cid)
        yield first, second
    finally:
        subprocess.run([*runsc, "kill", cid, "KILL"], check=False, capture_output=True)
        subprocess.run([*runsc, "delete", "--force", cid], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def test_real_checkpoints_are_incremental(checkpoints: tuple[Path, Path], config: dict,
                                          tmp_path: Path) -> None:
    first, second = checkpoints
    assert {p.name for p in first.iterdir()} >= {"checkpoint.img", "pages.img"}
    store = make_store(config, tmp_path / "node", adopt_staging=False)
    originals = {}
    manifests = {}
    for sid, src, parent in (("ck1", first, None), ("ck2", second, "ck1")):
        staging = store.new_staging(sid)
        for f in src.iterdir():
            shutil.copyfile(f, staging / f.name)
        originals[sid] = read_tree(staging)
        md = {"source_sandbox_id": "sbx", "template_id": "base", "runtime": "gvisor"}
        if parent:
            md["parent_snapshot_id"] = parent
        manifests[sid] = store.commit(sid, staging, md)
    full, incr = manifests["ck1"], manifests["ck2"]
    ratio = incr.stored_bytes / full.stored_bytes
    print(f"[{config['backend']}] full: {full.total_bytes} B raw, {full.stored_bytes} B stored; "
          f"after 1 MiB: {incr.total_bytes} B raw, {incr.stored_bytes} B stored "
          f"({100 * ratio:.2f}% of full)")
    assert full.stored_bytes > 40 << 20
    assert ratio <= 0.05
    for sid in ("ck1", "ck2"):
        assert not store.is_cached(sid)
        assert read_tree(store.materialize(sid)) == originals[sid]
