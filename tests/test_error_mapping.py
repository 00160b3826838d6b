"""Errors are mapped to HTTP in one place (web/errors.py's handlers): a route raises
the error as it came, and the answer is ``{"code": <status>, "message": "..."}`` with
the class's status and message prefix."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from agentenv.builds import BuildError
from agentenv.orchestrator import Conflict
from agentenv.snapshot import (
    CorruptSnapshot,
    RepositoryUnavailable,
    SnapshotExists,
    SnapshotNotFound,
    StorageFull,
)
from agentenv.web.errors import install_error_handlers

RAISED = {
    "not-found": SnapshotNotFound("snapshot 'nope' not found"),
    "full": StorageFull("no space left on device while committing: No space left"),
    "down": RepositoryUnavailable("bucket unreachable"),
    "corrupt": CorruptSnapshot("chunk abc does not match its hash"),
    "exists": SnapshotExists("snapshot s1 already exists"),
    "conflict": Conflict("sandbox 'x' is paused"),
    "too-large": BuildError("the context archive is larger than 2 GiB", 413),
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
])
async def test_an_error_is_answered_with_its_class_s_status_and_prefix(
        app: FastAPI, what: str, status: int, message: str) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        r = await client.get(f"/raise/{what}")
    assert r.status_code == status
    assert r.json() == {"code": status, "message": message}
    # A body refused unread is not read to its end: the connection closes instead.
    assert (r.headers.get("connection") == "close") == (status == 413)
