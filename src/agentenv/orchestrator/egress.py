"""A running sandbox's egress policy: replaced at any time, kept in its record (so
resume, fork and a restart put it back), and domains re-resolved as they change."""

from __future__ import annotations

import logging

from ..network import EgressPolicy
from .launch import Launcher
from .models import Conflict, SandboxRecord, SandboxState
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


class EgressPolicies:
    def __init__(self, sandboxes: SandboxTable, store: SandboxStore,
                 launcher: Launcher) -> None:
        self.sandboxes = sandboxes
        self.store = store
        self.launcher = launcher

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        """Replace a sandbox's egress policy; in force at once when it runs."""
        async with self.sandboxes.lock(sandbox_id):
            entry = self.sandboxes.get(sandbox_id)
            record = entry.record
            if record.state is SandboxState.CREATING:
                raise Conflict(f"sandbox '{sandbox_id}' is still being created")
            previous = (record.network, record.internet)
            record.network, record.internet = policy.to_json(), not policy.denies_all
            slot = entry.slot
            if record.state is SandboxState.RUNNING and slot is not None:
                try:
                    await self.launcher.apply_egress(sandbox_id, slot, record.network,
                                                     record.internet, force=True)
                except BaseException:
                    record.network, record.internet = previous
                    raise
            self.store.put(record)
            return record

    async def refresh_domains(self) -> None:
        """Re-resolve the domains of running sandboxes' policies (addresses change)."""
        for entry in self.sandboxes:
            record, slot = entry.record, entry.slot
            if record.state is not SandboxState.RUNNING or slot is None or not record.network:
                continue
            if not EgressPolicy.from_json(record.network).domains:
                continue
            try:
                async with entry.lock:
                    if entry.slot is slot:
                        await self.launcher.apply_egress(record.sandbox_id, slot,
                                                         record.network, record.internet)
            except Exception:
                log.exception("refreshing the egress policy of %s failed", record.sandbox_id)
