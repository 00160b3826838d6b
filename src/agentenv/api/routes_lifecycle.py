"""Routes that branch and freeze sandboxes: fork (and, with snapshots, pause/resume)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from ..orchestrator import OrchestratorError, SandboxManager
from . import models

router = APIRouter()


class ForkRequest(models._Body):
    count: int = Field(default=1, description="Children to create, 1..16")
    timeout: int | None = Field(default=None, description="Children's time to live in seconds")


class ForkError(models._Body):
    code: int
    message: str


class ForkResult(models._Body):
    sandbox: models.SandboxCreated | None = None
    error: ForkError | None = None


def _manager(request: Request) -> SandboxManager:
    return request.app.state.manager


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201, response_model=list[ForkResult],
             response_model_by_alias=True, response_model_exclude_none=True)
async def fork_sandbox(sandbox_id: str, body: ForkRequest, request: Request) -> list[ForkResult]:
    """Branch a running sandbox into children that continue its memory, processes and files."""
    results = await _manager(request).fork(sandbox_id, body.count, body.timeout)
    domain = request.app.state.config.domain
    out = []
    for result in results:
        if isinstance(result, OrchestratorError):
            out.append(ForkResult(error=ForkError(code=result.status, message=str(result))))
        else:
            out.append(ForkResult(sandbox=models.created(result, domain)))
    return out
