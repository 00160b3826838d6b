"""The node's REST routes (E2B-shaped): sandboxes, their metrics, and templates."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Annotated

import httpx
from fastapi import APIRouter, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ... import __version__
from ...builds import ImageSources, image_from_template
from ...envd.protocol import ENVD_PORT
from ...orchestrator import (
    BadRequest,
    CreateRequest,
    NotFound,
    SandboxManager,
    SandboxRecord,
    SandboxState,
)
from ...orchestrator import query as q
from ...orchestrator.idempotency import MAX_KEY_CHARS, check_key, fingerprint
from ...orchestrator.requests import MAX_BATCH
from ...sandbox_api import LISTED_HEADER
from ...web import shared_tls
from ...web.keys import caller
from .. import models
from . import network as network_routes

public = APIRouter()
router = APIRouter()

def manager(request: Request) -> SandboxManager:
    return request.app.state.manager


@public.get("/health", response_model=models.Health, response_model_by_alias=True)
async def health(request: Request) -> models.Health:
    mgr: SandboxManager = request.app.state.manager
    return models.Health(
        status="ok", node_id=mgr.config.node_id, sandboxes=len(mgr.list()), version=__version__
    )


def _domain(request: Request) -> str | None:
    return request.app.state.config.domain


def _internet(body: models.NewSandbox) -> bool:
    """Egress on or off as a whole (finer rules: ``network_routes.policy_of``)."""
    policy = network_routes.policy_of(body.network, body.allow_internet_access)
    return policy is None or not policy.denies_all


# -- sandboxes ----------------------------------------------------------------------

RUN_HEADER = "X-Aenv-Run"
RUN_METADATA = "aenv.run"


@router.post("/sandboxes", status_code=201, response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True)
@router.post("/v2/sandboxes", status_code=201, response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True)
async def create_sandbox(
    body: models.NewSandbox, request: Request,
    idem: Annotated[str | None, Header(alias="Idempotency-Key", max_length=MAX_KEY_CHARS,
                                       description="A retry with the same key (per API "
                                       "key) gets the first create's answer")] = None,
    run: Annotated[str | None, Header(alias=RUN_HEADER, max_length=64,
                                      description="The run the sandbox joins")] = None,
) -> Response:
    """A new sandbox. Beyond the node's room the create waits its turn (429 with
    Retry-After past the queue time); with an Idempotency-Key a retry gets the first
    answer; ``X-Aenv-Run`` (or metadata ``aenv.run``) puts it in a run."""
    mgr = manager(request)
    run_id = _run_of(run, body)
    owner = caller(request)

    async def make() -> dict:
        source = await _template_of(body, request)
        record = await mgr.create(_create_request(body, request, owner, run_id, source))
        return models.created(record, _domain(request)).model_dump(
            mode="json", by_alias=True, exclude_none=True)

    if idem is None:
        return _created(request, await make())
    check_key(idem)
    print_ = fingerprint({"run": run_id,
                          "body": body.model_dump(mode="json", by_alias=True)})
    return _created(request, await mgr.idempotency.once(owner, idem, print_, make))


def _created(request: Request, answer: dict) -> JSONResponse:
    """A create's 201, with the sandbox as a listing shows it in ``LISTED_HEADER``: a
    cluster's gateway indexes it at once, so a listing right after shows it (its
    node's heartbeat would only a moment later)."""
    headers = {}
    with contextlib.suppress(NotFound):
        record = manager(request).get(str(answer.get("sandboxID", "")))
        headers[LISTED_HEADER] = json.dumps(
            models.listed(record).model_dump(mode="json", by_alias=True),
            separators=(",", ":"))
    return JSONResponse(answer, status_code=201, headers=headers)


class NewSandboxes(models.NewSandbox):
    """A batch: ``count`` sandboxes of one create (``snapshotID`` may name the
    snapshot in place of ``templateID``, which also takes one)."""

    template_id: str = Field(default="", alias="templateID", max_length=256)
    snapshot_id: str = Field(default="", alias="snapshotID", max_length=256)
    count: int = Field(ge=1, le=MAX_BATCH, description=f"Sandboxes to create, 1..{MAX_BATCH}")


@router.post("/sandboxes/batch", status_code=201, response_model=list[models.ChildResult],
             response_model_by_alias=True, response_model_exclude_none=True,
             responses=models.NDJSON_RESPONSES)
async def create_sandboxes(
    body: NewSandboxes, request: Request,
    run: Annotated[str | None, Header(alias=RUN_HEADER, max_length=64)] = None,
) -> list[models.ChildResult] | StreamingResponse:
    """``count`` sandboxes from one template or snapshot, started at once from its one
    image; one result per sandbox (the sandbox, or its error) in the order they came
    up, or as NDJSON lines as each comes (``Accept: application/x-ndjson``). Each
    takes its turn for room as a create does: those that find none within the queue
    time are 429 results."""
    if bool(body.template_id or body.image) == bool(body.snapshot_id):
        raise BadRequest("give one of templateID (or image) and snapshotID")
    source = body.model_copy(update={"template_id": body.template_id or body.snapshot_id})
    req = _create_request(source, request, caller(request),
                          _run_of(run, body), await _template_of(source, request))
    return await models.children_answer(manager(request).create_each(req, body.count),
                                        request)


async def _template_of(body: models.NewSandbox, request: Request) -> str:
    """The template a create starts from: ``templateID``, or the template standing for
    ``image`` (or a ``docker://`` templateID), pulled and set up first if need be."""
    alias = image_from_template(body.template_id)
    if body.image is not None and body.template_id:
        raise BadRequest("give one of templateID and image")
    ref = body.image if body.image is not None else alias
    if ref is None:
        if not body.template_id:
            raise BadRequest("templateID (or image) is required")
        if body.image_setup is not None or body.image_credentials is not None or \
                body.image_loading is not None:
            raise BadRequest("imageSetup, imageCredentials and imageLoading go with image")
        return body.template_id
    creds = body.image_credentials.model_dump() if body.image_credentials else None
    images: ImageSources = request.app.state.images
    return await images.template_for(ref, creds, body.image_setup or "", body.image_loading)


def _create_request(body: models.NewSandbox, request: Request, owner: str,
                    run_id: str, template: str) -> CreateRequest:
    return CreateRequest(
        template=template,
        timeout=body.timeout,
        metadata=body.metadata or {},
        env_vars=body.env_vars or {},
        auto_pause=body.auto_pause,
        auto_pause_memory=body.auto_pause_memory,
        internet=_internet(body),
        network=network_routes.policy_of(body.network, body.allow_internet_access),
        public_traffic=network_routes.public_traffic(body.network),
        auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
        mask_request_host=network_routes.mask_request_host(body.network),
        owner=owner, run_id=run_id, client_gone=request.is_disconnected,
    )


def _run_of(header: str | None, body: models.NewSandbox) -> str:
    """The run a create joins: the X-Aenv-Run header or the metadata key aenv.run."""
    header = (header or "").strip()
    meta = (body.metadata or {}).get(RUN_METADATA, "")
    meta = meta.strip() if isinstance(meta, str) else ""
    if header and meta and header != meta:
        raise BadRequest(f"{RUN_HEADER} and metadata {RUN_METADATA!r} name different runs")
    return header or meta


@router.get("/sandboxes", response_model=list[models.ListedSandbox],
            response_model_by_alias=True)
async def list_sandboxes(request: Request, metadata: str | None = None
                         ) -> list[models.ListedSandbox]:
    """Every running sandbox (E2B's first listing: no paging), optionally by metadata."""
    query = q.SandboxQuery(metadata=q.parse_metadata(metadata), states=frozenset({"running"}))
    return [models.listed(r) for r in q.select(manager(request).list(), query)]


@router.get("/v2/sandboxes", response_model=list[models.ListedSandbox],
            response_model_by_alias=True)
async def list_sandboxes_v2(
    request: Request,
    response: Response,
    metadata: str | None = None,
    state: Annotated[list[str] | None, Query()] = None,
    template: str | None = None,
    started_after: str | None = Query(default=None, alias="startedAfter", max_length=64),
    started_before: str | None = Query(default=None, alias="startedBefore", max_length=64),
    order: str | None = None,
    limit: Annotated[int | None, Query(ge=1, le=q.MAX_PAGE)] = None,
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[models.ListedSandbox]:
    """A page of sandboxes; ``x-next-token`` names the next page when there is one."""
    if order not in (None, "", "asc", "desc"):
        raise BadRequest(f"invalid order {order!r}: expected 'asc' or 'desc'")
    if template and ":" in template:  # as E2B: a sandbox records its template, not a build
        raise BadRequest(f"invalid template {template[:200]!r}: tags are not supported here "
                         "because sandboxes are not tag-scoped")
    query = q.SandboxQuery(
        metadata=q.parse_metadata(metadata),
        states=q.parse_states(state or []),
        template=template or None,
        started_after=_parse_time(started_after, "startedAfter"),
        started_before=_parse_time(started_before, "startedBefore"),
        descending=order != "asc",  # E2B: newest first unless asked otherwise
    )
    result = q.page(manager(request).list(), query, limit=limit, next_token=next_token)
    if result.next_token:
        response.headers["x-next-token"] = result.next_token
    return [models.listed(r) for r in result.items]


def _parse_time(raw: str | None, name: str) -> int | None:
    if not raw:
        return None
    from datetime import datetime

    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"invalid {name} {raw!r}: expected an RFC 3339 time") from None
    if when.tzinfo is None:  # RFC 3339 wants a zone; a time without one is taken as UTC
        from datetime import UTC

        when = when.replace(tzinfo=UTC)
    return q.epoch_micros(when)


@router.get("/sandboxes/metrics", response_model=models.SandboxesWithMetrics,
            response_model_by_alias=True)
async def sandboxes_metrics(
    request: Request,
    # Comma-separated IDs; the pattern says at least one is named.
    sandbox_ids: Annotated[str, Query(pattern=r"[^,\s]")],
) -> models.SandboxesWithMetrics:
    """The latest metrics of each named running sandbox (unknown IDs are left out)."""
    ids = [s for s in dict.fromkeys(x.strip() for x in sandbox_ids.split(",")) if s]
    if not ids:
        raise BadRequest("sandbox_ids must name at least one sandbox")
    if len(ids) > 100:
        raise BadRequest("sandbox_ids names more than 100 sandboxes")
    out: dict[str, models.SandboxMetric] = {}
    for sid in ids:
        try:
            out[sid] = await _sample(request, sid)
        except NotFound:
            continue
    return models.SandboxesWithMetrics(sandboxes=out)


@router.get("/sandboxes/{sandbox_id}", response_model=models.SandboxDetail,
            response_model_by_alias=True)
async def get_sandbox(sandbox_id: str, request: Request) -> models.SandboxDetail:
    return models.detail(_alive(request, sandbox_id), _domain(request))


def _alive(request: Request, sandbox_id: str) -> SandboxRecord:
    """A sandbox that can still be used. One whose runtime died is, to the E2B API, gone
    (a 404, as E2B answers; its SDKs know no 'error' state), with the reason said; its
    record stays listed under ``state=error`` until deleted or expired."""
    record = manager(request).get(sandbox_id)
    if record.state is SandboxState.ERROR:
        raise NotFound(f"sandbox '{sandbox_id}' is not running: {record.error} (its record "
                       f"stays until DELETE /sandboxes/{sandbox_id} or its timeout)")
    return record


@router.get("/sandboxes/{sandbox_id}/metrics", response_model=list[models.SandboxMetric],
            response_model_by_alias=True)
async def sandbox_metrics(sandbox_id: str, request: Request, start: int | None = None,
                          end: int | None = None) -> list[models.SandboxMetric]:
    """The sandbox's current sample (the node keeps no history), if it falls in [start, end]."""
    if start is not None and end is not None and start > end:
        raise BadRequest("start must not be after end")
    sample = await _sample(request, sandbox_id)
    if (start is not None and sample.timestamp_unix < start) or (
            end is not None and sample.timestamp_unix > end):
        return []
    return [sample]


SAMPLE_FIELDS = ("cpu_count", "mem_used", "mem_total", "mem_cache", "disk_used", "disk_total")


def _last_samples(request: Request) -> dict[str, dict]:
    """Each running sandbox's last sample, kept for while it is frozen."""
    state = request.app.state
    if not hasattr(state, "last_metric_samples"):
        state.last_metric_samples = {}
    return state.last_metric_samples


async def _sample(request: Request, sandbox_id: str) -> models.SandboxMetric:
    mgr = manager(request)
    record = mgr.get(sandbox_id)
    last = _last_samples(request)
    # A frozen sandbox uses no CPU and its memory does not move: its last sample
    # stands, so a dashboard polling metrics does not keep every sandbox thawed. Nor
    # does anything move in one whose envd is dormant (nothing runs in it then).
    if record.state is SandboxState.RUNNING and sandbox_id in last and (
            mgr.frozen(sandbox_id) or mgr.envd_dormant(sandbox_id)):
        return models.metric({**last[sandbox_id], "cpu_used_pct": 0.0, "ts": int(time.time())})
    address, port = mgr.endpoint(sandbox_id, ENVD_PORT)
    # A client per call: slot addresses are reused by later sandboxes, so no pooling.
    async with httpx.AsyncClient(timeout=5.0, trust_env=False, verify=shared_tls()) as http:
        try:
            r = await http.get(httpx.URL(scheme="http", host=address, port=port,
                                         path="/metrics"),
                               headers={"X-Access-Token": record.envd_token})
        except httpx.HTTPError as exc:
            raise _Unavailable(f"sandbox '{sandbox_id}' did not report metrics: {exc}") from exc
    if r.status_code != 200:
        raise _Unavailable(f"sandbox '{sandbox_id}' did not report metrics: HTTP {r.status_code}")
    sample = r.json()
    sample.setdefault("ts", int(time.time()))
    metric = models.metric(sample)  # (a malformed sample fails here, before it is kept)
    if len(last) >= 4 * max(1, mgr.config.max_sandboxes):  # drop those of gone sandboxes
        live = {r.sandbox_id for r in mgr.list()}
        for gone in [sid for sid in last if sid not in live]:
            del last[gone]
    # (only the fields a sample has: what a sandbox's envd answers is its own to shape)
    last[sandbox_id] = {k: sample[k] for k in SAMPLE_FIELDS if k in sample}
    return metric


class _Unavailable(HTTPException):
    def __init__(self, message: str) -> None:
        super().__init__(502, message)


@router.post("/sandboxes/{sandbox_id}/connect", response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True,
             responses={201: {"model": models.SandboxCreated,
                              "description": "A paused sandbox, resumed"}})
@router.post("/v2/sandboxes/{sandbox_id}/connect", response_model=models.SandboxCreated,
             response_model_by_alias=True, response_model_exclude_none=True,
             include_in_schema=False)
async def connect_sandbox(
    sandbox_id: str, request: Request, response: Response,
    body: models.ConnectRequest | None = None,
) -> models.SandboxCreated:
    """Connect to a running sandbox (200), or resume a paused one (201).
    A timeout given only ever extends a running sandbox's TTL."""
    mgr = manager(request)
    record = _alive(request, sandbox_id)
    if record.state is SandboxState.PAUSED:
        record = await mgr.resume(sandbox_id, body.timeout if body else None,
                                  memory=body.memory if body else True)
        response.status_code = 201
        return models.created(record, _domain(request))
    if body is not None and body.timeout is not None and \
            body.timeout > request.app.state.config.max_timeout:
        raise BadRequest(f"timeout must be at most {request.app.state.config.max_timeout} "
                         "seconds")
    if body is not None and body.timeout is not None and time.time() + body.timeout > record.end_at:
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


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, request: Request,
                  body: models.RefreshRequest | None = None) -> Response:
    """E2B's keep-alive: the sandbox lives ``duration`` more seconds (default the node's)."""
    mgr = manager(request)
    duration = body.duration if body is not None else None  # (0..3600: the model's bounds)
    await mgr.set_timeout(sandbox_id, duration)
    return Response(status_code=204)


from . import templates as template_routes  # noqa: E402  (after the sandbox routes)

router.include_router(template_routes.router)
router.include_router(network_routes.router)
from . import runs as run_routes  # noqa: E402

router.include_router(run_routes.router)
