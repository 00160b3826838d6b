"""Node routes only the cluster uses: adopt a paused sandbox, serve chunks to peers, status."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

from ..api import models
from ..envd.protocol import file_signature
from ..orchestrator import NotFound, SandboxManager, SandboxState
from .heartbeat import node_status
from .peer import read_cached_chunk

router = APIRouter(prefix="/cluster")


class AdoptRequest(models._Body):
    snapshot_id: str = Field(alias="snapshotID", min_length=1, max_length=128)


def _manager(request: Request) -> SandboxManager:
    return request.app.state.manager


@router.post("/sandboxes/{sandbox_id}/adopt", status_code=201,
             response_model=models.SandboxDetail, response_model_by_alias=True)
async def adopt(sandbox_id: str, body: AdoptRequest, request: Request) -> models.SandboxDetail:
    """Take over a paused sandbox from its committed pause snapshot (its node is gone)."""
    record = await _manager(request).adopt_paused(sandbox_id, body.snapshot_id)
    return models.detail(record, request.app.state.config.domain)


@router.get("/chunks/{digest}")
async def chunk(digest: str, snapshot: str, request: Request) -> Response:
    """A chunk of a snapshot this node caches, zstd-compressed (the caller verifies it)."""
    store = _manager(request).snapshots
    blob = await asyncio.to_thread(read_cached_chunk, store, snapshot, digest)
    if blob is None:
        raise NotFound(f"chunk {digest} of snapshot {snapshot} is not cached on this node")
    return Response(blob, media_type="application/octet-stream")


@router.get("/signers")
async def signer(request: Request, signature: str, operation: str, path: str = "",
                 username: str = "", signature_expiration: int | None = None
                 ) -> dict[str, str]:
    """Which running sandbox here signed a ``/files`` URL (the gateway routes such a
    URL, which names no sandbox, by asking every node; envd tokens stay here)."""
    for record in _manager(request).list():
        if record.state is not SandboxState.RUNNING or not record.envd_token:
            continue
        expected = file_signature(path, operation, username, record.envd_token,
                                  signature_expiration)
        if hmac.compare_digest(expected.encode(), signature.encode()):
            return {"sandboxID": record.sandbox_id}
    raise NotFound("no sandbox on this node signed that URL")


@router.get("/status")
async def status(request: Request) -> dict[str, Any]:
    """What the node heartbeats, plus peer-transfer and admission counters."""
    mgr = _manager(request)
    cfg = request.app.state.config
    body = node_status(mgr, cfg.advertise_url or f"http://{cfg.host}:{cfg.port}").to_dict()
    body["peer"] = getattr(mgr.snapshots.repo, "stats", None)
    body["admission"] = mgr.admission.stats()
    body["bootImages"] = mgr.boot_images.stats() if mgr.boot_images is not None else None
    return body
