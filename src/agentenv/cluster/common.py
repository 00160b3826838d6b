"""What the scheduler, the gateway and the nodes share: the cluster's errors, and
the schedulers' addresses."""

from __future__ import annotations

from ..errors import AgentenvError


class ClusterError(AgentenvError):
    """An error answered as ``{"code": status, "message": ...}`` (web.errors does that)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status



def scheduler_urls(value: str) -> list[str]:
    """``scheduler_url`` as given: one URL or several, comma-separated (schedulers are
    stateless over Redis: any one serves; a caller tries the next when one is down)."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


class Failover:
    """The schedulers a caller tries in turn, the last that answered first."""

    def __init__(self, value: str) -> None:
        self.urls = scheduler_urls(value) or ["http://127.0.0.1:9090"]
        self._first = 0

    def order(self) -> list[str]:
        return self.urls[self._first:] + self.urls[:self._first]

    def answered(self, url: str) -> None:
        self._first = self.urls.index(url)
