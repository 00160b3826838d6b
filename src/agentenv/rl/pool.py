"""An async pool of N environments (sandboxes) from one template or snapshot.

    async with EnvPool(url, key, snapshot="swe-task", size=8, run_name="ppo") as pool:
        async with pool.env() as env:            # acquire; released and reset after
            await env.upload("/work/patch.diff", patch)
            code, out, err = await env.exec("cd /work && git apply patch.diff && pytest", 60)

Each env comes back to its start state when released (``reset``): in place
(``POST /sandboxes/{id}/reset`` to the pool's snapshot: same ID and token) where the
node has it, else killed and created anew. Creates carry an ``Idempotency-Key`` and
are retried as the server asks (``Retry-After``); at most ``max_inflight`` creates or
resets go at once. The pool's sandboxes belong to a run whose lease it keeps alive,
and which it deletes on close; every sandbox is also tagged with the pool's ID in its
metadata, and close sweeps any the server still lists, so nothing outlives the pool.

``url`` is a node's or a gateway's, or several gateways' (a list, or comma-separated):
a request that cannot connect to one goes to the next (``agentenv.failover``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

from .envd import Envd, ExecResult
from .http import Api, ApiError, RetryPolicy, failover_client
from .runs import RUN_HEADER, RUN_METADATA, RunLease

log = logging.getLogger(__name__)

POOL_METADATA = "aenv.rl.pool"
MAX_POOL = 1024
T = TypeVar("T")
R = TypeVar("R")


class Env:
    """One environment: a sandbox of the pool, used by one rollout at a time."""

    def __init__(self, pool: EnvPool, created: dict[str, Any]) -> None:
        self.pool = pool
        self._adopt(created)
        self.resets = 0

    def _adopt(self, created: dict[str, Any]) -> None:
        self.sandbox_id: str = created["sandboxID"]
        self.token: str | None = created.get("envdAccessToken")
        self.envd = Envd(self.pool._envd_http, self.sandbox_id, self.token)

    # envd enforces the timeout (it kills the command), so it is a parameter.
    async def exec(self, cmd: str, timeout: float = 60.0,  # noqa: ASYNC109
                   **kw: Any) -> ExecResult:
        """(exit_code, stdout, stderr) of ``bash -c cmd``; see ``Envd.exec``."""
        return await self.envd.exec(cmd, timeout, **kw)

    async def upload(self, path: str, data: bytes) -> None:
        await self.envd.upload(path, data)

    async def download(self, path: str) -> bytes:
        return await self.envd.download(path)

    async def reset(self) -> None:
        """Back to the pool's start state (in place where the node can)."""
        await self.pool._reset(self)
        self.resets += 1

    async def snapshot(self, name: str | None = None) -> str:
        """Capture this env (it stops only for the capture): a snapshot ID that a
        pool (``snapshot=``), a create or a reset can start from."""
        r = await self.pool.api.call("POST", f"/sandboxes/{self.sandbox_id}/snapshots",
                                     json={"name": name} if name else {}, retry_errors=False)
        return str(r.json()["snapshotID"])

    async def close(self) -> None:
        await self.pool._kill(self.sandbox_id)


class EnvPool:
    def __init__(self, api_url: str | Sequence[str], api_key: str, *,
                 template: str | None = None,
                 snapshot: str | None = None, size: int = 8, run_name: str = "rl",
                 lease_s: int = 300, sandbox_timeout_s: int = 3600,
                 max_inflight: int | None = None, retry: RetryPolicy | None = None,
                 metadata: dict[str, str] | None = None, reset_mode: str = "memory") -> None:
        if (template is None) == (snapshot is None):
            raise ValueError("give one of template= or snapshot=")
        if reset_mode not in ("memory", "filesystem"):
            raise ValueError("reset_mode must be 'memory' or 'filesystem'")
        # filesystem: for tasks whose state is their files, an env's resets after its
        # first are done in place by envd in milliseconds, no restore (docs/api.md).
        self.reset_mode = reset_mode
        if not 1 <= size <= MAX_POOL:
            raise ValueError(f"size must be 1..{MAX_POOL}")
        self.source = snapshot or template or ""
        self.snapshot = snapshot
        self.size = size
        self.sandbox_timeout_s = sandbox_timeout_s
        self.pool_id = uuid.uuid4().hex[:16]
        self.metadata = {**(metadata or {}), POOL_METADATA: self.pool_id}
        self.api = Api(api_url, api_key, retry, max_connections=2 * size + 8)
        self._envd_http = failover_client(api_url, 2 * size + 8)
        self.run = RunLease(self.api, run_name, lease_s)
        self._inflight = asyncio.Semaphore(max_inflight or size)
        # None in it wakes a waiter to see that envs were lost (see _lose).
        self._idle: asyncio.Queue[Env | None] = asyncio.Queue()
        self._envs: dict[int, Env] = {}
        self._pending: set[asyncio.Task] = set()
        # None: not known yet; False: the node has no reset (404/405), so kill + create.
        self.reset_in_place: bool | None = None if snapshot else False
        self._closed = False
        self._lost: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> EnvPool:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        await self.run.start()
        envs = await asyncio.gather(*(self._new_env() for _ in range(self.size)))
        for env in envs:
            self._idle.put_nowait(env)

    async def close(self) -> None:
        """Kill every sandbox of the pool and end its run; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        try:
            if self.run.run_id is None:
                await asyncio.gather(*(self._kill(e.sandbox_id) for e in self._envs.values()),
                                     return_exceptions=True)
            await self.run.close()
            await self._sweep()
        finally:
            self._envs.clear()
            await self.api.aclose()
            await self._envd_http.aclose()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.api.call("DELETE", f"/snapshots/{snapshot_id}", ok=(204, 404),
                            deadline_s=60)

    async def _sweep(self) -> None:
        """Kill whatever the server still lists with this pool's tag (a create whose
        answer was lost before the server knew idempotency keys, say)."""
        meta = f"{quote(POOL_METADATA)}={quote(self.pool_id)}"
        with contextlib.suppress(ApiError):
            r = await self.api.call("GET", "/sandboxes", params={"metadata": meta},
                                    deadline_s=30)
            await asyncio.gather(*(self._kill(s["sandboxID"]) for s in r.json()),
                                 return_exceptions=True)

    # -- handing envs out -------------------------------------------------------------
    async def acquire(self) -> Env:
        while True:
            if self._closed:
                raise RuntimeError("the pool is closed")
            if not self._envs:
                self._idle.put_nowait(None)  # the next waiter learns it too
                raise RuntimeError(f"the pool lost every environment: {self._lost!r}")
            env = await self._idle.get()
            if env is not None:
                return env

    def release(self, env: Env, reset: bool = True) -> None:
        """Give ``env`` back; with ``reset`` it is reset (in the background) first."""
        if self._closed or id(env) not in self._envs:
            return
        if not reset:
            self._idle.put_nowait(env)
            return
        task = asyncio.create_task(self._reset_and_return(env))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _reset_and_return(self, env: Env) -> None:
        try:
            await env.reset()
        except Exception as e:
            log.warning("env %s: reset failed (%s); it leaves the pool", env.sandbox_id, e)
            self._envs.pop(id(env), None)
            await self._kill(env.sandbox_id)
            try:
                env = await self._new_env()  # the pool keeps its size
            except Exception as again:
                self._lose(again)
                return
        self._idle.put_nowait(env)

    def _lose(self, why: BaseException) -> None:
        """An env is gone for good: the pool is smaller (and waiters must not wait
        for envs that will never come)."""
        log.warning("the pool is one environment short: %s", why)
        self._lost = why
        self._idle.put_nowait(None)

    @contextlib.asynccontextmanager
    async def env(self, reset: bool = True) -> AsyncIterator[Env]:
        env = await self.acquire()
        try:
            yield env
        finally:
            self.release(env, reset)

    async def map(self, fn: Callable[[Env, T], Awaitable[R]], items: Iterable[T]) -> list[R]:
        """``fn(env, item)`` for every item, as many at once as the pool has envs; each
        env is reset between items. Results in the items' order."""
        async def one(item: T) -> R:
            async with self.env() as env:
                return await fn(env, item)
        return list(await asyncio.gather(*(one(i) for i in items)))

    # -- server calls -----------------------------------------------------------------
    async def _create(self) -> dict[str, Any]:
        metadata = dict(self.metadata)
        headers = {"Idempotency-Key": uuid.uuid4().hex}  # one key over every retry
        if self.run.run_id is not None:
            headers[RUN_HEADER] = self.run.run_id
            metadata[RUN_METADATA] = self.run.run_id
        async with self._inflight:
            r = await self.api.call("POST", "/sandboxes", headers=headers, json={
                "templateID": self.source, "timeout": self.sandbox_timeout_s,
                "autoPause": False, "metadata": metadata})
        return r.json()

    async def _new_env(self) -> Env:
        env = Env(self, await self._create())
        self._envs[id(env)] = env
        return env

    async def _kill(self, sandbox_id: str) -> None:
        with contextlib.suppress(ApiError):
            async with self._inflight:
                await self.api.call("DELETE", f"/sandboxes/{sandbox_id}", ok=(204, 404),
                                    deadline_s=60)

    async def _reset(self, env: Env) -> None:
        if self.reset_in_place is not False:
            try:
                async with self._inflight:
                    r = await self.api.call(
                        "POST", f"/sandboxes/{env.sandbox_id}/reset",
                        json={"snapshotID": self.snapshot, "timeout": self.sandbox_timeout_s,
                              **({"mode": self.reset_mode}
                                 if self.reset_mode != "memory" else {})},
                        retry_errors=False)
            except ApiError as e:
                if e.status not in (404, 405) or "sandbox" in e.message.lower():
                    raise
                self.reset_in_place = False  # this node has no reset: kill + create
            else:
                self.reset_in_place = True
                token = r.json().get("envdAccessToken")
                if token and token != env.token:
                    env._adopt(r.json())
                return
        old = env.sandbox_id
        await self._kill(old)
        env._adopt(await self._create())


async def timed(coro: Awaitable[T]) -> tuple[T, float]:
    """``coro``'s result and how long it took (seconds), for per-phase timings."""
    t0 = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - t0
