"""The node's ASGI application: REST API, auth, errors, body limits, sandbox proxy."""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI
from starlette.types import ASGIApp

from .. import __version__, metrics
from ..api.limits import BodyLimitMiddleware
from ..api.proxy import SandboxProxy
from ..api.routes.images import router as image_router
from ..api.routes.lifecycle import router as lifecycle_router
from ..api.routes.sandboxes import public, router
from ..api.routes.templates import unlimited_uploads
from ..api.routes.templates import uploads as template_uploads
from ..api.signed_files import SignedFileRouter
from ..api.terminal import router as terminal_router
from ..builds import ImageSources, TemplateBuilder, TemplateCleanup
from ..config import Config
from ..images.registry_hosts import RegistryPolicy, set_default_policy
from ..network import SlotPool
from ..network.policy import parse_opened
from ..orchestrator import SandboxManager, SandboxState, SandboxStore
from ..resources import host_memory_mb
from ..runtime import GVisorRuntime
from ..runtime.swap import ensure_compressed_swap
from ..snapshot import SnapshotStore, open_repository
from ..snapshot.shared_templates import SharedTemplates
from ..templates import TemplateRegistry
from ..web.console import ConsoleSessions, console_router
from ..web.errors import document_errors, install_error_handlers, serve_openapi
from ..web.keys import ApiKeys, load_or_create_api_key, require_api_key
from .cluster_routes import router as cluster_router
from .load import LoadHistory
from .load import router as load_router

log = logging.getLogger(__name__)
API_BODY_LIMIT = 1 << 20  # 1 MiB: far above any sandbox request, far below harm


def build_manager(config: Config) -> SandboxManager:
    config.home.mkdir(parents=True, exist_ok=True, mode=0o755)
    runtime = GVisorRuntime(config.run_dir, cgroup_parent=config.net_prefix)
    if config.cold_memory_after_s > 0:  # where frozen sandboxes' memory goes
        ensure_compressed_swap(-1 if config.cold_swap_mb < 0 else
                               config.cold_swap_mb or host_memory_mb() // 4)
    # Where image pulls may send requests (registry, token realm, redirects).
    set_default_policy(RegistryPolicy(tuple(
        x.strip() for x in config.registry_private.split(",") if x.strip())))
    slots = SlotPool(
        prefix=config.net_prefix,
        pool_cidr=config.net_pool_cidr,
        low=config.net_pool_low,
        high=config.net_pool_high,
        capacity=config.max_sandboxes,
        private_open=parse_opened(config.egress_private_open),
    )
    repository = open_repository(config.snapshot_repository())
    if config.peer_transfer and config.scheduler_url:
        from .heartbeat import advertised_url
        from .peer import PeerRepository

        repository = PeerRepository(repository, config.scheduler_url,
                                    load_or_create_api_key(config.secrets_dir),
                                    advertised_url(config))
    snapshots = SnapshotStore(
        repository,
        cache_dir=config.snapshot_cache_dir,
        staging_dir=config.home / "snapshots-staging",
        image_retention_s=config.image_index_retention_days * 86400,
        image_budget_bytes=config.image_index_budget_bytes,
    )
    templates = TemplateRegistry(config.templates_dir, config.local_templates_dir,
                                 config.rootfs_mounts_dir)
    if config.scheduler_url:  # a cluster node: templates are shared through the repository
        templates.remote = SharedTemplates(repository)
    return SandboxManager(config, runtime, slots, templates, SandboxStore(config.db_path),
                          snapshots)


def create_app(config: Config) -> ASGIApp:
    api_key = load_or_create_api_key(config.secrets_dir)
    manager = build_manager(config)
    builder = TemplateBuilder(manager, config.home)
    proxy_holder: dict[str, SandboxProxy] = {}

    def by_state() -> dict[str, int]:
        return dict(collections.Counter(str(r.state) for r in manager.list()))

    load_history = LoadHistory(by_state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        unregister = [metrics.register(metrics.HostCollector()), metrics.register(
            metrics.CountsCollector("aenv_sandboxes", "Sandboxes on this node, by state",
                                    "state", by_state, always=[str(s) for s in SandboxState]))]
        metrics.QUEUE_LENGTH.set_function(lambda: manager.admission.waiting)
        metrics.FROZEN.set_function(manager.runtime.frozen_count)
        await manager.start()
        await builder.start()
        await cleanup.start()
        load_history.start()
        log.info("node %s serving on %s:%d (home %s)", config.node_id, config.host, config.port,
                 config.home)
        heartbeat = None
        if config.scheduler_url:  # a cluster node: register and keep heartbeating
            from .heartbeat import Heartbeat, advertised_url

            heartbeat = Heartbeat(manager, config.scheduler_url, advertised_url(config), api_key,
                                  config.heartbeat_interval_ms / 1000)
            heartbeat.start()
        try:
            yield
        finally:
            if heartbeat is not None:
                await heartbeat.close()
            await load_history.close()
            await cleanup.close()
            await proxy_holder["proxy"].close()
            await builder.close()
            await manager.close(destroy=True)
            manager.store.close()
            manager.runbook.close()
            manager.idempotency.close()
            for undo in unregister:
                undo()
            log.info("node stopped cleanly")

    # The API document is served to key holders only (see docs/security.md); the
    # browsable /docs and /redoc pages are off: they could not send the key.
    app = FastAPI(title="agentenv node API", version=__version__, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.api_key = api_key
    # Re-read on change: `aenv keys rotate` takes effect without a restart.
    app.state.api_keys = ApiKeys(config.secrets_dir)
    app.state.manager = manager
    app.state.builder = builder
    app.state.load_history = load_history
    # Creates straight from an image reference (and their setup builds).
    app.state.images = ImageSources(builder, config.secrets_dir)
    # Those templates removed once unused for image_template_idle_s.
    cleanup = TemplateCleanup(app.state.images, config.image_template_idle_s)
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(template_uploads)
    app.include_router(router, dependencies=[Depends(require_api_key)])
    app.include_router(lifecycle_router, dependencies=[Depends(require_api_key)])
    app.include_router(cluster_router, dependencies=[Depends(require_api_key)])
    app.include_router(image_router, dependencies=[Depends(require_api_key)])
    app.include_router(load_router, dependencies=[Depends(require_api_key)])
    # The web console: its pages need a session, its terminal checks the key itself.
    app.include_router(console_router())
    app.include_router(terminal_router)
    app.include_router(metrics.metrics_router(require_api_key))
    document_errors(app)
    serve_openapi(app, require_api_key)
    # Console sessions are turned into the key inside the sandbox proxy: never sent on.
    counted = metrics.RequestCounter(ConsoleSessions(app, app.state))
    limited = unlimited_uploads(BodyLimitMiddleware(counted, API_BODY_LIMIT,
                                                    config.http_body_timeout), app)
    proxy = SandboxProxy(limited, manager, config.domain)
    proxy_holder["proxy"] = proxy
    manager.on_removed.append(proxy.forget)
    manager.on_capture.append(proxy.release_idle)
    return SignedFileRouter(proxy, manager.list, config.domain)
