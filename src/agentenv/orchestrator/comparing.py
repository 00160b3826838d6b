"""What changed in the files between two sandboxes or snapshots: each side a running
sandbox's envd, or a sandbox restored from the snapshot for the purpose (killed after);
the listings, exports and text diffs are ``diffing.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..envd.protocol import ENVD_PORT
from ..snapshot import Manifest
from . import diffing, disk_pause
from .diffing import DiffGate
from .envd_client import EnvdClient, EnvdUnavailable
from .models import Conflict, OrchestratorError, SandboxRecord, SandboxState
from .requests import CreateRequest
from .table import SandboxTable


class Diffs:
    def __init__(self, sandboxes: SandboxTable, envd: EnvdClient, gate: DiffGate,
                 work_dir: Path, resolve_snapshot: Callable[[str, str], Awaitable[Manifest]],
                 create: Callable[[CreateRequest], Awaitable[SandboxRecord]],
                 kill: Callable[[str], Awaitable[None]],
                 endpoint: Callable[[str, int], tuple[str, int]]) -> None:
        self.sandboxes = sandboxes
        self.envd = envd
        self.gate = gate  # diffs in flight, per key and in all
        self.work_dir = work_dir
        self._resolve_snapshot = resolve_snapshot  # (name, what to say when missing)
        self._create = create
        self._kill = kill
        self._endpoint = endpoint

    async def diff(self, before: str, after: str, text: bool = False,
                   owner: str = "", may_restore: bool = True) -> dict:
        """What changed in the files from ``before`` to ``after`` (diffing.py): each a
        running sandbox of this node, or a snapshot (ID or name), restored for the
        purpose into a sandbox of its own that is killed afterwards."""
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(self.gate.hold(owner))  # a 429 past its limits
            work = stack.enter_context(diffing.scratch_dir(self.work_dir))
            if not may_restore:
                for ref in (before, after):
                    self._check_no_restore(ref)
            sides = [await self._diff_side(ref, stack, owner) for ref in (before, after)]
            listings = []
            for i, (address, token) in enumerate(sides):
                raw = work / f"listing-{i}"
                try:
                    await self.envd.disk_download(address, token, "list", raw,
                                                  disk_pause.MAX_LISTING_BYTES)
                except EnvdUnavailable as exc:
                    raise OrchestratorError(f"listing the files of "
                                            f"'{(before, after)[i]}' failed: {exc}") from exc
                listings.append(await asyncio.to_thread(diffing.parse_listing, raw))
            result = await asyncio.to_thread(diffing.compare, *listings)
            if text:
                paths = diffing.text_candidates(result, *listings)
                body = work / "paths.jsonl"
                await asyncio.to_thread(diffing.paths_body, paths, body)
                versions = []
                for i, (address, token) in enumerate(sides):
                    tar = work / f"export-{i}.tar"
                    try:
                        await self.envd.disk_download(address, token, "export", tar,
                                                      diffing.EXPORT_LIMIT, body=body)
                    except EnvdUnavailable as exc:
                        raise OrchestratorError(f"reading files of '{(before, after)[i]}' "
                                                f"failed: {exc}") from exc
                    versions.append(await asyncio.to_thread(diffing.read_export, tar, paths))
                items, skipped = diffing.text_work(paths, versions, listings)
                result["diffs"] = await asyncio.to_thread(diffing.diffs, items)
                if skipped:
                    result["notDiffed"] = skipped
        return {"from": before, "to": after, **result}

    async def _diff_side(self, ref: str, stack: contextlib.AsyncExitStack,
                         owner: str) -> tuple[str, str]:
        """Where envd of ``ref``'s files answers: a running sandbox's own, or that of a
        sandbox restored from the snapshot ``ref`` names (killed when ``stack`` ends)."""
        entry = self.sandboxes.find(ref)
        record = entry.record if entry is not None else None
        if record is None or record.state is SandboxState.KILLED:
            manifest = await self._resolve_snapshot(ref, f"no sandbox or snapshot '{ref}'")
            record = await self._create(CreateRequest(
                template=manifest.snapshot_id, timeout=600, internet=False, owner=owner,
                metadata={"aenv.purpose": f"files of snapshot {manifest.snapshot_id} for a "
                                          "diff"}))
            stack.push_async_callback(self._kill_quietly, record.sandbox_id)
        if record.state is not SandboxState.RUNNING:
            raise Conflict(f"sandbox '{ref}' is {record.state}: only a running sandbox's "
                           "files can be compared (resume it first)")
        address, _ = self._endpoint(record.sandbox_id, ENVD_PORT)
        return address, record.envd_token

    def _check_no_restore(self, ref: str) -> None:
        entry = self.sandboxes.find(ref)
        if entry is None or entry.state is SandboxState.KILLED:
            err = OrchestratorError(
                f"'{ref}' is no running sandbox of this node: comparing a snapshot restores "
                "it into a temporary sandbox, which a GET does not do; send the same "
                "request as a POST")
            err.status, err.headers = 405, {"Allow": "POST"}
            raise err

    async def _kill_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(OrchestratorError):
            await asyncio.shield(self._kill(sandbox_id))
