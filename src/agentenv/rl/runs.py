"""A run's lease, kept for the user: created at the start, heartbeated in the
background, deleted at the end (which deletes the run's sandboxes). A trainer that
dies without closing leaks nothing past its lease. A server without ``/runs`` (404)
is served without a lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .http import Api, ApiError

log = logging.getLogger(__name__)

RUN_HEADER = "X-Aenv-Run"
RUN_METADATA = "aenv.run"
MIN_LEASE_S = 5
MAX_LEASE_S = 86400


class RunLease:
    def __init__(self, api: Api, name: str, lease_s: int, on_expiry: str = "kill") -> None:
        self.api = api
        self.name = name
        self.lease_s = min(max(int(lease_s), MIN_LEASE_S), MAX_LEASE_S)
        self.on_expiry = on_expiry
        self.run_id: str | None = None
        self._beat: asyncio.Task | None = None

    async def start(self) -> str | None:
        """The run's ID, or None when the server has no runs."""
        try:
            r = await self.api.call("POST", "/runs", json={
                "name": self.name, "leaseSeconds": self.lease_s, "onExpiry": self.on_expiry})
        except ApiError as e:
            if e.status in (404, 405):
                log.info("the server has no /runs: no lease for %s", self.name)
                return None
            raise
        self.run_id = str(r.json()["runID"])
        self._beat = asyncio.create_task(self._heartbeat())
        return self.run_id

    async def _heartbeat(self) -> None:
        # A third of the lease: two beats may fail before it lapses.
        every = max(self.lease_s / 3, 1.0)
        while True:
            await asyncio.sleep(every)
            try:
                await self.api.call("POST", f"/runs/{self.run_id}/heartbeat",
                                    deadline_s=every)
            except ApiError as e:
                log.warning("run %s: heartbeat failed: %s", self.run_id, e)

    async def close(self) -> None:
        """Stop the heartbeat and delete the run (and with it, its sandboxes)."""
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
            self._beat = None
        if self.run_id is not None:
            with contextlib.suppress(ApiError):
                await self.api.call("DELETE", f"/runs/{self.run_id}", ok=(204, 404),
                                    deadline_s=60)
            self.run_id = None
