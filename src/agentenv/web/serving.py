"""How the node serves HTTP: uvicorn's h11 server with a deadline for each request head.

uvicorn times out idle keep-alive connections but not a request whose head is
still arriving: a client trickling header bytes (slowloris) holds its
connection, and a file descriptor, for as long as it likes, and enough of them
exhaust the node's descriptors for everyone. Here every request head must be
complete within ``head_timeout`` seconds of the connection opening (or of the
previous response), else the connection is closed. Request bodies get their
own deadline in ``limits.BodyLimitMiddleware``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeadDeadlineH11(H11Protocol):
    head_timeout: float = 10.0
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        # A new request cycle object is the sign that a whole head arrived.
        self._waiting_cycle = self.cycle
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_expired)

    def _cancel_head_deadline(self) -> None:
        deadline = getattr(self, "_head_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._head_deadline = None

    def handle_events(self) -> None:
        super().handle_events()
        # A head arrived, or the connection became a WebSocket (another protocol's now).
        if self.cycle is not self._waiting_cycle or self.transport.get_protocol() is not self:
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this connection, unless a pipelined one already started.
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._head_deadline = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %.0fs",
                             self.head_timeout)
            if self.conn.our_state is not h11.ERROR:
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.close()


def protocol_with_head_timeout(head_timeout: float) -> type[asyncio.Protocol]:
    """The h11 protocol class for uvicorn's ``http=`` with this head deadline."""
    return type("HeadDeadlineH11", (_HeadDeadlineH11,), {"head_timeout": float(head_timeout)})


def server_options(head_timeout: float) -> dict[str, Any]:
    """uvicorn.run options for the node's API server."""
    return {
        "http": protocol_with_head_timeout(head_timeout),
        # Idle keep-alive connections go after 5 s (uvicorn's default, said here).
        "timeout_keep_alive": 5,
        # No limit_concurrency: it answers 503 to everyone once slow clients hold
        # that many connections, which is exactly the starvation to avoid.
    }
