"""Incremental snapshots of REAL gVisor checkpoint images, both backends.

A small runsc sandbox (overlay root in memory, no network) holds 24 MiB of
random data in a Python process; it is checkpointed (leave-running, no
compression), 512 KiB are written to a file inside it, and it is checkpointed
again (half the bytes of the first version of this test: the oss backend's
server, moto, costs ~10 ms a chunk). The second snapshot must store at most 5%
of what the first stored, and both must come back byte-identical.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.testing.checkpoints import two_checkpoints
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

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    work = tmp_path_factory.mktemp("runsc")
    try:
        yield two_checkpoints(work, ROOTFS, 24, change_kib=512)
    finally:
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
          f"after 512 KiB: {incr.total_bytes} B raw, {incr.stored_bytes} B stored "
          f"({100 * ratio:.2f}% of full)")
    assert full.stored_bytes > 24 << 20
    assert ratio <= 0.05
    for sid in ("ck1", "ck2"):
        assert not store.is_cached(sid)
        assert read_tree(store.materialize(sid)) == originals[sid]
