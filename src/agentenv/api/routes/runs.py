"""Runs (an agentenv extension for RL trainers): a run owns the sandboxes created in it
(``X-Aenv-Run`` or metadata ``aenv.run``) and ends, with them, when its lease lapses
or on DELETE (``orchestrator/runs.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ...orchestrator import SandboxManager
from ...orchestrator.runbook import DEFAULT_LEASE_S, Run

router = APIRouter()


class NewRun(BaseModel):
    # Checked by the orchestrator (clear 400s); typed loosely so that it can.
    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    name: Any = None
    lease_seconds: Any = Field(default=DEFAULT_LEASE_S, alias="leaseSeconds")
    on_expiry: Any = Field(default="kill", alias="onExpiry")


class RunInfo(BaseModel):
    run_id: str = Field(serialization_alias="runID")
    name: str
    lease_seconds: int = Field(serialization_alias="leaseSeconds")
    on_expiry: str = Field(serialization_alias="onExpiry")
    expires_at: datetime = Field(serialization_alias="expiresAt")
    sandboxes: int


def _manager(request: Request) -> SandboxManager:
    return request.app.state.manager


def _info(mgr: SandboxManager, run: Run) -> RunInfo:
    return RunInfo(run_id=run.run_id, name=run.name, lease_seconds=run.lease_s,
                   on_expiry=run.on_expiry,
                   expires_at=datetime.fromtimestamp(run.expires_at, tz=UTC),
                   sandboxes=len(mgr.run_members(run.run_id)))


@router.post("/runs", status_code=201, response_model=RunInfo, response_model_by_alias=True)
async def create_run(body: NewRun, request: Request) -> RunInfo:
    mgr = _manager(request)
    return _info(mgr, mgr.create_run(body.name, body.lease_seconds, body.on_expiry))


@router.get("/runs", response_model=list[RunInfo], response_model_by_alias=True)
async def list_runs(request: Request) -> list[RunInfo]:
    mgr = _manager(request)
    return [_info(mgr, run) for run in mgr.runbook.list()]


@router.get("/runs/{run_id}", response_model=RunInfo, response_model_by_alias=True)
async def get_run(run_id: str, request: Request) -> RunInfo:
    mgr = _manager(request)
    return _info(mgr, mgr.runbook.get(run_id))


@router.post("/runs/{run_id}/heartbeat", response_model=RunInfo, response_model_by_alias=True)
async def heartbeat(run_id: str, request: Request) -> RunInfo:
    mgr = _manager(request)
    return _info(mgr, mgr.runbook.renew(run_id))


@router.delete("/runs/{run_id}", status_code=204)
async def delete_run(run_id: str, request: Request) -> Response:
    await _manager(request).end_run(run_id)
    return Response(status_code=204)
