"""What the node itself says to envd inside a sandbox: readiness and /init."""

from __future__ import annotations

import asyncio
import time

import httpx

ENVD_PORT = 49983


class EnvdUnavailable(RuntimeError):
    pass


class EnvdClient:
    def __init__(self) -> None:
        # No pooling across sandboxes: slot addresses are reused by new sandboxes.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False)

    async def close(self) -> None:
        await self._http.aclose()

    async def wait_ready(self, address: str, deadline_s: float = 15.0) -> None:
        """Poll ``GET /health`` until envd answers.

        envd listens before it finishes starting, so a probe usually connects at
        once and waits for the answer; retries only cover the moments before that.
        """
        url = f"http://{address}:{ENVD_PORT}/health"
        end = time.monotonic() + deadline_s
        delay = 0.005
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                r = await self._http.get(url, timeout=max(0.1, end - time.monotonic()))
                if r.status_code < 500:
                    return
            except httpx.HTTPError as exc:
                last = exc
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.02)
        raise EnvdUnavailable(f"envd did not answer within {deadline_s:.0f}s ({last!r})")

    async def init(
        self, address: str, access_token: str, env_vars: dict[str, str], default_user: str = "user"
    ) -> None:
        body = {
            "envVars": env_vars,
            "accessToken": access_token,
            "defaultUser": default_user,
            "timestamp": _rfc3339_now(),
        }
        r = await self._http.post(f"http://{address}:{ENVD_PORT}/init", json=body)
        if r.status_code >= 300:
            raise EnvdUnavailable(f"envd /init answered {r.status_code}")


def _rfc3339_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
