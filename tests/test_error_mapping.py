"""Errors are mapped to HTTP in one place (web/errors.py's handlers): a route raises
the error as it came, and the answer is ``{"code": <status>, "message": "..."}`` with
the class's status and message prefix."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from agentenv.builds import BuildError
from agentenv.images import ImageInUse
from agentenv.orchestrator import Conflict
from agentenv.snapshot import (
    CorruptSnapshot,
    RepositoryUnavailable,
    SnapshotExists,
    SnapshotNotFound,
    StorageFull,
)
from agentenv.web.errors import install_error_handlers, status_and_message

RAISED = {
    "not-found": SnapshotNotFound("snapshot 'nope' not found"),
    "full": StorageFull("no space left on device while committing: No space left"),
    "down": RepositoryUnavailable("bucket unreachable"),
    "corrupt": CorruptSnapshot("chunk abc does not match its hash"),
    "exists": SnapshotExists("snapshot s1 already exists"),
    "conflict": Conflict("sandbox 'x' is paused"),
    "too-large": BuildError("the context archive is larger than 2 GiB", 413),
    "in-use": ImageInUse("image template 'a' is in use by 1 sandbox(es) (s1); kill them first"),
    "bug": KeyError("secret-looking detail"),
}


@pytest.fixture(scope="module")
def app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/raise/{what}")
    async def raising(what: str) -> None:
        raise RAISED[what]

    return app


@pytest.mark.parametrize(("what", "status", "message"), [
    ("not-found", 404, "snapshot 'nope' not found"),
    ("full", 507, "snapshot storage is full: no space left on device while committing: "
                  "No space left"),
    ("down", 503, "snapshot repository unavailable: bucket unreachable"),
    ("corrupt", 500, "snapshot: chunk abc does not match its hash"),
    ("exists", 409, "snapshot: snapshot s1 already exists"),
    ("conflict", 409, "sandbox 'x' is paused"),
    ("too-large", 413, "the context archive is larger than 2 GiB"),
    ("in-use", 409, "image template 'a' is in use by 1 sandbox(es) (s1); kill them first"),
    ("bug", 500, "internal error: KeyError"),
])
async def test_an_error_is_answered_with_its_class_s_status_and_prefix(
        app: FastAPI, what: str, status: int, message: str) -> None:
    # Starlette re-raises an unexpected error once answered: the answer is what counts.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        r = await client.get(f"/raise/{what}")
    assert r.status_code == status
    assert r.json() == {"code": status, "message": message}
    # An answer already streaming (an image pull's last line) says the same.
    assert status_and_message(RAISED[what]) == (status, message)
    # A body refused unread is not read to its end: the connection closes instead.
    assert (r.headers.get("connection") == "close") == (status == 413)
