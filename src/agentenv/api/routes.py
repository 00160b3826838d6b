"""The node's REST routes (E2B-shaped)."""

from __future__ import annotations

from fastapi import APIRouter, Header, Request, Response

from .. import __version__
from ..orchestrator import CreateRequest, SandboxManager
from . import models
from .auth import key_matches

public = APIRouter()
router = APIRouter()


def manager(request: Request) -> SandboxManager:
    return request.app.state.manager


async def require_api_key(
    request: Request, x_api_key: str | None = Header(default=None, alias="X-API-Key")
) -> None:
    if not key_matches(x_api_key, request.app.state.api_key):
        from fastapi import HTTPException

        raise HTTPException(status_code=401, detail="missing or invalid X-API-Key header")


@public.get("/health", response_model=models.Health, response_model_by_alias=True)
async def health(request: Request) -> models.Health:
    mgr: SandboxManager = request.app.state.manager
    return models.Health(
        status="ok", node_id=mgr.config.node_id, sandboxes=len(mgr.list()), version=__version__
    )


def _domain(request: Request) -> str | None:
    return request.app.state.config.domain


@router.post("/sandboxes", status_code=201, response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True)
@router.post("/v2/sandboxes", status_code=201, response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True,
             include_in_schema=False)
async def create_sandbox(body: models.NewSandbox, request: Request) -> models.SandboxCreated:
    mgr = manager(request)
    record = await mgr.create(
        CreateRequest(
            template=body.template_id,
            timeout=body.timeout,
            metadata=body.metadata or {},
            env_vars=body.env_vars or {},
            auto_pause=body.auto_pause,
            internet=body.allow_internet_access is not False,
        )
    )
    return models.created(record, _domain(request))


@router.get("/sandboxes", response_model=list[models.ListedSandbox], response_model_by_alias=True)
async def list_sandboxes(request: Request) -> list[models.ListedSandbox]:
    return [models.listed(r) for r in manager(request).list()]


@router.get("/sandboxes/{sandbox_id}", response_model=models.SandboxDetail,
            response_model_by_alias=True)
async def get_sandbox(sandbox_id: str, request: Request) -> models.SandboxDetail:
    return models.detail(manager(request).get(sandbox_id), _domain(request))


@router.post("/sandboxes/{sandbox_id}/connect", response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True)
@router.post("/v2/sandboxes/{sandbox_id}/connect", response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True,
             include_in_schema=False)
async def connect_sandbox(
    sandbox_id: str, request: Request, body: models.ConnectRequest | None = None
) -> models.SandboxCreated:
    """Connect to a running sandbox; a timeout given extends its TTL."""
    mgr = manager(request)
    record = mgr.get(sandbox_id)
    if body is not None and body.timeout is not None:
        record = await mgr.set_timeout(sandbox_id, body.timeout)
    return models.created(record, _domain(request))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    await manager(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: models.TimeoutRequest, request: Request) -> Response:
    await manager(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)
