"""Every error crosses the API as JSON ``{"code": <status>, "message": "..."}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from ..errors import AgentenvError

log = logging.getLogger(__name__)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def public_message(exc: AgentenvError) -> str:
    """What a client is told of an error: its class's prefix, then its own message."""
    return f"{exc.message_prefix}: {exc}" if exc.message_prefix else str(exc)


def status_and_message(exc: BaseException) -> tuple[int, str]:
    """The status and message any error is answered with: an ``AgentenvError``'s own,
    else a 500 that names the error's type only. The handlers below answer with it;
    so does an answer already streaming (an image pull's last line), which no handler
    can reach."""
    if isinstance(exc, AgentenvError):
        return exc.status, public_message(exc)
    return 500, f"internal error: {type(exc).__name__}"


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def _allowed_methods(request: Request) -> str:
    """The methods the API document gives this path: Starlette names only those of
    the first route whose path matched, and a path here can have several routes."""
    app = request.app
    paths = getattr(app.state, "method_table", None)
    if paths is None:
        paths = []
        for path, ops in app.openapi().get("paths", {}).items():
            regex, _, params = compile_path(path)
            paths.append((regex, len(params), {m.upper() for m in ops}))
        app.state.method_table = paths
    matched = [(n, ops) for regex, n, ops in paths if regex.match(request.url.path)]
    # /sandboxes/metrics is that resource, not /sandboxes/{sandbox_id}.
    fewest = min((n for n, _ in matched), default=0)
    methods = set().union(*(ops for n, ops in matched if n == fewest))
    return ", ".join(sorted(methods))


def _close_if_body_unread(response: JSONResponse) -> JSONResponse:
    if response.status_code in (408, 413):
        # The rest of the body is not wanted: close rather than read it to its end.
        response.headers["Connection"] = "close"
    return response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AgentenvError)
    async def _agentenv(_: Request, exc: AgentenvError) -> JSONResponse:
        if exc.status >= 500:
            log.error("request failed: %s", exc)
        response = error_response(*status_and_message(exc))
        response.headers.update(exc.headers or {})  # e.g. Retry-After
        return _close_if_body_unread(response)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        # Headers the exception carries are part of the answer (WWW-Authenticate).
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            response.headers["Allow"] = _allowed_methods(request)
        return _close_if_body_unread(response)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(*status_and_message(exc))


ERROR_SCHEMA = {
    "title": "Error",
    "type": "object",
    "required": ["code", "message"],
    "properties": {"code": {"type": "integer"}, "message": {"type": "string"}},
}


def document_errors(app: FastAPI) -> None:
    """Say in the OpenAPI document what the handlers above do: an invalid request
    is a 400 (not FastAPI's 422) and every other error has the same JSON shape,
    so clients and fuzzers can check error answers against the document."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        ref = {"$ref": "#/components/schemas/Error"}
        error = {"description": "Error", "content": {"application/json": {"schema": ref}}}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {**error, "description": "Invalid request"}
                responses.setdefault("default", error)
        schema["components"]["schemas"].pop("HTTPValidationError", None)
        schema["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def serve_openapi(app: FastAPI, require_key: Callable[..., Awaitable[None]]) -> None:
    """``GET /openapi.json`` for key holders only: the document names every route, the
    version and the cluster's internal routes, and anyone who can reach the port could
    read it otherwise. Create the app with ``openapi_url=None`` first."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_key)])
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())
