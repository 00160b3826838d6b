"""A sandbox manager over the in-memory fakes of agentenv.testing, for the
orchestrator's unit tests (test_orchestrator_*.py): the record store, snapshot store
(a posix_fs repository) and template registry are the real ones, on a temporary
directory."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentenv.config import Config
from agentenv.orchestrator import SandboxManager, SandboxStore
from agentenv.orchestrator import specs as specs_module
from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.templates import TemplateRegistry
from agentenv.testing.fakes import FakeEnvd, FakeRuntime, FakeSlots


class Node:
    """A manager over fakes; ``restart()`` makes a new one on the same home and runtime."""

    def __init__(self, root: Path, capacity: int, slots: int, resident: bool = False,
                 idle_s: int = 600, capture_delay_ms: int = 0,
                 idle_freeze_s: float = 10.0) -> None:
        self.root = root
        templates = root / "images" / "templates" / "base"
        (templates / "rootfs").mkdir(parents=True, exist_ok=True)
        (templates / "template.json").write_text(json.dumps(
            {"templateID": "base", "aliases": ["base"], "cpuCount": 64, "memoryMB": 256}))
        self.config = Config(home=root / "home", images_dir=root / "images",
                             max_sandboxes=capacity, template_snapshots=False,
                             max_cpu_count=2, max_memory_mb=1024, node_id="unit",
                             resident_pause=resident, resident_pause_idle_s=idle_s,
                             resident_capture_delay_ms=capture_delay_ms,
                             admission_queue_timeout_s=1.0, idle_freeze_s=idle_freeze_s)
        self.runtime = FakeRuntime()
        self.slots = FakeSlots(slots)
        self.envd = FakeEnvd()
        self.manager = self._manager()

    def _manager(self) -> SandboxManager:
        cfg = self.config
        snapshots = SnapshotStore(open_repository(cfg.snapshot_repository()),
                                  cache_dir=cfg.home / "cache" / "snapshots",
                                  staging_dir=cfg.home / "snapshots-staging")
        return SandboxManager(cfg, self.runtime, self.slots,  # type: ignore[arg-type]
                              TemplateRegistry(cfg.templates_dir, cfg.local_templates_dir,
                                               cfg.rootfs_mounts_dir),
                              SandboxStore(cfg.db_path), snapshots,
                              envd=self.envd)  # type: ignore[arg-type]

    async def restart(self) -> SandboxManager:
        await self.manager.close(destroy=False)
        self.manager.store.close()
        import os
        os.close(self.manager._home_lock)  # the process would end here
        self.manager = self._manager()
        await self.manager.start()
        return self.manager

    def clean(self) -> bool:
        return not self.slots.holding and not self.runtime.sandboxes




@contextlib.asynccontextmanager
async def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  **kwargs: Any) -> AsyncIterator[Node]:
    """A started manager over fakes, closed (its sandboxes destroyed) afterwards."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # envd's real bundle is built (and tested) by the node tests; here only its name counts.
    monkeypatch.setattr(specs_module, "build_bundle", lambda _dir: bundle)
    n = Node(tmp_path, **kwargs)
    await n.manager.start()
    try:
        yield n
    finally:
        await n.manager.close(destroy=True)
        n.manager.store.close()

