"""The node's room as admission sees it (admission.py): whether one more sandbox fits
now (sandboxes and slots held, sandboxes starting at once), how many each API key
holds, each key's quotas; and a create's turn for room, which joins its run only if
that run still goes on once admitted."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import Config
from .admission import Admission, Quota, Ticket
from .boot_images import BootImages
from .models import SandboxState
from .requests import CreateRequest
from .runbook import RunBook
from .table import SandboxTable


@dataclass(eq=False, repr=False)
class Room:
    config: Config
    sandboxes: SandboxTable
    runbook: RunBook

    # Set once built (the boot images take the manager that holds this room).
    boot_images: BootImages | None = None

    def __post_init__(self) -> None:
        configured = self.config.admission_max_starting
        self._max_starting = configured if configured else max(4, 2 * (os.cpu_count() or 1))
        # Creates beyond the node's room wait here, fair across API keys (admission.py).
        self.admission = Admission(
            timeout_s=self.config.admission_queue_timeout_s,
            max_waiting=self.config.admission_queue_max,
            no_room=self.no_room, owned=self.owned, quotas=self.quota)

    def no_room(self, reserved: int, starting: bool = True) -> str | None:
        """Why one more sandbox does not fit now, with ``reserved`` creates admitted but
        not yet recorded (None: it fits). A sandbox being torn down still holds its slot
        until the slot is handed back, so it still counts (a burst right after kills
        otherwise found "no network slot free"); a resident paused one does not (a
        launch evicts it when it needs the slot)."""
        cap = self.config.max_sandboxes
        busy = sum(1 for e in self.sandboxes
                   if e.state in (SandboxState.CREATING, SandboxState.RUNNING)
                   or (e.slot is not None and e.state is not SandboxState.PAUSED))
        if self.boot_images is not None:  # captures of boot images, pooled sandboxes
            busy += self.boot_images.slots_held()
        if busy + reserved >= cap:
            if self.boot_images is not None and self.boot_images.shed():
                return "a warm-pool sandbox is giving up its room"
            return (f"node is at capacity ({cap} sandboxes, counting those whose slots "
                    "are being released)")
        limit = self._max_starting
        if starting and limit > 0:
            launching = len(self.sandboxes.in_state(SandboxState.CREATING))
            if launching + reserved >= limit:
                return f"{limit} sandboxes are starting, the most at once"
        return None

    def owned(self, owner: str) -> int:
        return sum(1 for e in self.sandboxes.in_state(SandboxState.CREATING,
                                                      SandboxState.RUNNING)
                   if e.record.owner == owner)

    def quota(self, owner: str) -> Quota:
        own = self.config.key_quotas.get(owner) or {}
        return Quota(int(own.get("max_sandboxes", self.config.key_max_sandboxes)),
                     float(own.get("creates_per_s", self.config.key_creates_per_s)))

    async def admit(self, req: CreateRequest) -> Ticket:
        """Wait for room for a create (admission.py); it joins its run (if it names
        one) only if that run is still going once admitted."""
        self.runbook.check_joinable(req.run_id)
        ticket = await self.admission.admit(req.owner, req.client_gone)
        try:
            self.runbook.check_joinable(req.run_id)
        except BaseException:
            ticket.release()
            raise
        return ticket

