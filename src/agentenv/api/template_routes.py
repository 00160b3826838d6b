"""Templates as the E2B SDKs and CLI list them (read-only: builds are another API)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from ..orchestrator import BadRequest, NotFound
from ..templates import Template, TemplateNotFound, TemplateRegistry
from . import models

router = APIRouter()
MAX_PAGE = 100


def _registry(request: Request) -> TemplateRegistry:
    return request.app.state.manager.templates


def _spawned(request: Request) -> dict[str, int]:
    """Running sandboxes per template ID (the node keeps no history of past ones)."""
    counts: dict[str, int] = {}
    for record in request.app.state.manager.list():
        counts[record.template_id] = counts.get(record.template_id, 0) + 1
    return counts


def _get(request: Request, name: str) -> Template:
    try:
        return _registry(request).get(name)
    except TemplateNotFound as exc:
        raise NotFound(str(exc)) from exc


@router.get("/templates", response_model=list[models.TemplateInfo],
            response_model_by_alias=True)
async def list_templates(request: Request, team_id: str | None = Query(default=None,
                                                                       alias="teamID")
                         ) -> list[models.TemplateInfo]:
    counts = _spawned(request)
    return [models.template_info(t, counts.get(t.template_id, 0))
            for t in _registry(request).list()]


@router.get("/v2/templates", response_model=list[models.TemplateInfo],
            response_model_by_alias=True)
async def list_templates_v2(
    request: Request,
    response: Response,
    team_id: str | None = Query(default=None, alias="teamID"),
    limit: int | None = None,
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[models.TemplateInfo]:
    """Templates by ID; ``x-next-token`` (the last ID handed out) when more remain."""
    limit = MAX_PAGE if limit is None else limit
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"limit must be between 1 and {MAX_PAGE}")
    templates = sorted(_registry(request).list(), key=lambda t: t.template_id)
    if next_token:
        templates = [t for t in templates if t.template_id > next_token]
    chosen = templates[:limit]
    if len(templates) > limit:
        response.headers["x-next-token"] = chosen[-1].template_id
    counts = _spawned(request)
    return [models.template_info(t, counts.get(t.template_id, 0)) for t in chosen]


@router.get("/templates/aliases/{alias}", response_model=models.TemplateAlias,
            response_model_by_alias=True)
async def template_by_alias(alias: str, request: Request) -> models.TemplateAlias:
    for template in _registry(request).list():
        if alias in template.aliases or alias == template.template_id:
            return models.TemplateAlias(template_id=template.template_id)
    raise NotFound(f"template alias '{alias}' not found")


@router.get("/templates/{template_id}", response_model=models.TemplateWithBuilds,
            response_model_by_alias=True)
async def get_template(template_id: str, request: Request) -> models.TemplateWithBuilds:
    template = _get(request, template_id)
    return models.template_with_builds(template, _spawned(request).get(template.template_id, 0))
