"""One node wired together: its ASGI app (API, proxy, auth, errors), and, in a cluster,
its heartbeat to the scheduler and the snapshot chunks it shares with peers."""

from .app import build_manager, create_app

__all__ = ["build_manager", "create_app"]
