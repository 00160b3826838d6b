"""Prometheus metrics of the node, the gateway and the scheduler (`prometheus_client`).

Each server is a process of its own with the library's default registry: counters and
histograms are module-level and updated where the work happens; what a listing can
say (sandboxes by state, nodes by state, host memory) is read at scrape time by a
collector the server registers, so nothing has to be kept in step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fastapi import APIRouter

# Lifecycle steps take from milliseconds (a thaw) to a minute (a cold pull).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

LIFECYCLE = Histogram(
    "aenv_lifecycle_seconds",
    "Time a sandbox lifecycle operation took on this node, by operation and outcome",
    ["operation", "outcome"], buckets=_SECONDS)
FIRST_COMMAND = Histogram(
    "aenv_first_command_seconds",
    "Time until a sandbox's first command started, from the start of its request "
    "(through the node's proxy)", buckets=_SECONDS)
FREEZES = Counter(
    "aenv_sandbox_freezes_total", "Idle running sandboxes frozen in place (idle_freeze_s)")
THAW_SECONDS = Histogram(
    "aenv_sandbox_thaw_seconds", "Time a thaw of an idle frozen sandbox took, on the "
    "request that woke it", buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05))
PRESSURE_PAUSES = Counter(
    "aenv_pressure_pauses_total", "Sandboxes paused to disk because host memory ran low "
    "(memory_pressure_mb)")
FROZEN = Gauge("aenv_sandboxes_frozen", "Running sandboxes frozen now because idle")
RECLAIMS = Counter(
    "aenv_sandbox_reclaims_total", "Frozen sandboxes whose memory moved to the host's "
    "compressed swap (cold_memory_after_s)")
RECLAIMED_BYTES = Counter(
    "aenv_sandbox_reclaimed_bytes_total", "Bytes of frozen sandboxes' memory moved out "
    "of RAM to the host's compressed swap")
REFUSALS = Counter(
    "aenv_create_refusals_total", "Creates refused, by reason", ["reason"])
QUEUE_LENGTH = Gauge(
    "aenv_create_queue_length", "Creates waiting for room on this node")
SNAPSHOT_BYTES = Counter(
    "aenv_snapshot_bytes_total",
    "Bytes of committed snapshots: 'captured' in all, 'stored' newly written to the "
    "repository (the rest was deduplicated against chunks it held)", ["kind"])
CACHE_LOOKUPS = Counter(
    "aenv_cache_lookups_total", "Node-local cache lookups, by cache and result",
    ["cache", "result"])
EVICTIONS = Counter(
    "aenv_evictions_total",
    "What a node let go of to make room: image layers, cached snapshots, resident pauses",
    ["kind"])
PLACEMENTS = Counter(
    "aenv_placements_total", "Placements made (by a gateway, or a scheduler asked), by result",
    ["result"])
CLUSTER_NODES = Gauge("aenv_cluster_nodes", "Registered nodes, by state", ["state"])
CLUSTER_SANDBOXES = Gauge("aenv_cluster_sandboxes", "Sandboxes on the nodes that are up, "
                          "as their last heartbeats said")
CLUSTER_CAPACITY = Gauge("aenv_cluster_capacity", "Sandboxes the nodes that are up can hold")
HTTP_REQUESTS = Counter(
    "aenv_http_requests_total", "Requests answered by this server's API, by method and status",
    ["method", "code"])


@contextlib.contextmanager
def timed(operation: str) -> Iterator[None]:
    """Observe how long the block took into ``aenv_lifecycle_seconds``: its outcome is
    ``ok``, or ``error`` when it raised (a cancellation counts as neither)."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        LIFECYCLE.labels(operation, "error").observe(time.perf_counter() - t0)
        raise
    LIFECYCLE.labels(operation, "ok").observe(time.perf_counter() - t0)


P = ParamSpec("P")
R = TypeVar("R")


Async = Callable[P, Coroutine[Any, Any, R]]


def observed(operation: str) -> Callable[[Async[P, R]], Async[P, R]]:
    """``timed`` for a whole coroutine function."""
    def decorate(fn: Async[P, R]) -> Async[P, R]:
        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with timed(operation):
                return await fn(*args, **kwargs)
        return run
    return decorate


def cache_lookup(cache: str, hit: bool) -> None:
    CACHE_LOOKUPS.labels(cache, "hit" if hit else "miss").inc()


class HostCollector(Collector):
    """The host's memory and CPU as the kernel reports them, read at each scrape."""

    def collect(self) -> Iterable[Metric]:
        memory = GaugeMetricFamily("aenv_host_memory_bytes", "Host memory (/proc/meminfo)",
                                   labels=["kind"])
        info = _meminfo()
        for kind, key in (("total", "MemTotal"), ("available", "MemAvailable")):
            if key in info:
                memory.add_metric([kind], info[key])
        yield memory
        cpu = CounterMetricFamily("aenv_host_cpu_seconds", "Host CPU time by mode (/proc/stat)",
                                  labels=["mode"])
        for mode, seconds in _cpu_seconds().items():
            cpu.add_metric([mode], seconds)
        yield cpu
        yield GaugeMetricFamily("aenv_host_cpus", "CPUs of the host", value=os.cpu_count() or 0)
        load = GaugeMetricFamily("aenv_host_load1", "Host load average over one minute")
        with contextlib.suppress(OSError, ValueError):
            load.add_metric([], float(open("/proc/loadavg").read().split()[0]))
        yield load


class CountsCollector(Collector):
    """A gauge whose values come from a function at scrape time, e.g. sandboxes by state."""

    def __init__(self, name: str, documentation: str, label: str,
                 counts: Callable[[], dict[str, int]], always: Sequence[str] = ()) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.counts, self.always = counts, always

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=[self.label])
        counts = {k: 0 for k in self.always} | self.counts()
        for key, value in sorted(counts.items()):
            family.add_metric([key], value)
        yield family


def register(collector: Collector) -> Callable[[], None]:
    """Add a collector to the registry; the returned function takes it out again (a
    server that stops, or a second app in one process, as the tests make)."""
    REGISTRY.register(collector)
    return lambda: _unregister(collector)


def _unregister(collector: Collector) -> None:
    with contextlib.suppress(KeyError):
        REGISTRY.unregister(collector)


def metrics_router(require_key: Callable[..., Any]) -> APIRouter:
    """``GET /metrics`` in Prometheus's text format, behind the server's key (sent as
    ``X-API-Key`` or, as Prometheus sends credentials, ``Authorization: Bearer``)."""
    # Here, not at the top: processes that only count (a lazy layer server imports the
    # snapshot store) must not pay fastapi's import, ~0.3 s of each one's start.
    from fastapi import APIRouter, Depends, Response

    router = APIRouter()

    @router.get("/metrics", dependencies=[Depends(require_key)], include_in_schema=False,
                response_model=None)
    async def metrics() -> Any:
        # On the event loop: the collectors read the servers' live state, which only
        # the loop changes. A scrape is a few milliseconds, bounded by the metric count.
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return router


class RequestCounter:
    """ASGI middleware: count each HTTP answer by method and status."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        method = method if method in _METHODS else "other"

        async def counting(message: Any) -> None:
            if message["type"] == "http.response.start":
                HTTP_REQUESTS.labels(method, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


_CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _cpu_seconds() -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for line in open("/proc/stat"):
            if line.startswith("cpu "):
                values = line.split()[1:]
                return {mode: int(v) / tick for mode, v in zip(_CPU_MODES, values, strict=False)}
    return {}
