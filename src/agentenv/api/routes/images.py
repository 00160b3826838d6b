"""Pulled images (our extension of the E2B API): pull an image as a template, list, delete.

``POST /images`` answers with NDJSON progress lines (per layer bytes) ending in
``{"status": "done", "template": ...}``. The answer waits for the image to
resolve and up to ``HOLD_S`` more, so that errors found by then (bad reference,
image not found, registry unreachable, hostile input, cache too small) are
plain JSON errors with their status; later ones end the stream with
``{"status": "error", "code": ..., "message": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ...builds import check_name_not_reserved
from ...images import ImageInUse, ImageService
from ...templates import TemplateNotFound
from ...web.errors import error_response, status_and_message
from ..models import ImageCredentials

log = logging.getLogger(__name__)
router = APIRouter()
HOLD_S = 2.0


class PullRequest(BaseModel):
    image: str = Field(max_length=1024)
    name: str = Field(max_length=63)
    credentials: ImageCredentials | None = None
    # "lazy", "unpack", or "auto" (lazy above the node's image_lazy_above_mb); None:
    # the node's image_loading. Kept in the template: its starts on any node follow it.
    loading: Literal["auto", "lazy", "unpack"] | None = None


def _service(request: Request) -> ImageService:
    return request.app.state.manager.image_cache


def _line(event: dict) -> bytes:
    return (json.dumps(event) + "\n").encode()


@router.post("/images", response_model=None)
async def pull_image(request: Request, body: PullRequest) -> Response:
    service = _service(request)
    # The image's template must not hide a snapshot of that name.
    check_name_not_reserved(body.name)
    await request.app.state.builder.check_not_a_snapshot(body.name)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict | BaseException | None] = asyncio.Queue()
    cancel = threading.Event()

    def progress(event: dict) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    def run() -> None:
        try:
            service.pull(body.image, body.name,
                         body.credentials.model_dump() if body.credentials else None,
                         progress=progress, cancel=cancel, loading=body.loading)
            service.templates.publish(body.name)  # for the cluster's other nodes
            loop.call_soon_threadsafe(events.put_nowait, None)
        except BaseException as exc:
            loop.call_soon_threadsafe(events.put_nowait, exc)

    worker = asyncio.create_task(asyncio.to_thread(run))
    # Hold the answer until the image is resolved and for a short grace after: the
    # errors of a bad reference, a missing image or a small hostile one get a real
    # status; a long pull streams its progress.
    first: list[dict] = []
    deadline = loop.time() + HOLD_S
    while True:
        try:
            timeout = None if not first or first[-1].get("status") == "resolving" \
                else max(0.0, deadline - loop.time())
            item = await asyncio.wait_for(events.get(), timeout)
        except TimeoutError:
            break
        if isinstance(item, BaseException):
            await worker
            if isinstance(item, Exception):
                raise item  # answered by the error handlers (web/errors.py)
            return error_response(*status_and_message(item))
        if item is None:
            break
        first.append(item)

    async def stream() -> AsyncIterator[bytes]:
        try:
            for event in first:
                yield _line(event)
            if first and first[-1].get("status") == "done":
                return
            while True:
                item = await events.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    # The answer's status is sent: the error is the stream's last line.
                    status, message = status_and_message(item)
                    if status >= 500:
                        log.error("image pull failed: %s", message, exc_info=item)
                    yield _line({"status": "error", "code": status, "message": message})
                    return
                yield _line(item)
        finally:
            # A client gone mid-pull stops the download; the store removes the half layer.
            cancel.set()
            await asyncio.shield(worker)

    return StreamingResponse(stream(), media_type="application/x-ndjson")


@router.get("/images")
async def list_images(request: Request) -> dict:
    service = _service(request)
    images = await asyncio.to_thread(service.list)
    # ``cache``: the layers; ``localCache``: the node's one budget, layers and snapshots.
    local = await asyncio.to_thread(request.app.state.manager.local_cache.usage)
    return {"images": images, "cache": service.usage(), "localCache": local}


@router.delete("/images/{name}", status_code=204, response_model=None)
async def delete_image(request: Request, name: str) -> Response:
    """Not while any sandbox, running or paused, is of the template (a paused one
    resumes from it); its layers go unless another template uses them."""
    manager = request.app.state.manager
    try:
        template = manager.templates.get(name)
    except TemplateNotFound:
        template = None
    if template is not None:
        users = [r.sandbox_id for r in manager.list() if r.template_id == template.template_id]
        if users:
            raise ImageInUse(f"image template '{name}' is in use by {len(users)} "
                             f"sandbox(es) ({', '.join(users[:3])}); kill them first")
    await asyncio.to_thread(_service(request).delete, name)
    if template is not None:
        await asyncio.to_thread(manager.templates.unpublish, template)
    return Response(status_code=204)
