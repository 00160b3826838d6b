"""How the node serves HTTP: uvicorn's h11 server with a deadline for each request head.

uvicorn times out idle keep-alive connections but not a request whose head is
still arriving: a client trickling header bytes (slowloris) holds its
connection, and a file descriptor, for as long as it likes, and enough of them
exhaust the node's descriptors for everyone. Here every request head must be
complete within ``head_timeout`` seconds of the connection opening, or of its first
byte on a kept-alive connection, else the connection is closed. Request bodies get
their own deadline in ``limits.BodyLimitMiddleware``.

Idle keep-alive connections are kept longer than any client keeps them
(``KEEP_ALIVE_S``): the e2b SDK pools idle connections 300 s (``E2B_KEEPALIVE_EXPIRY``),
and an agent's next request comes after a think gap of seconds to minutes. A server
that closes first races the client's next request on that connection, which is lost
("connection error", "Server disconnected without sending a response"; seen after
5 s gaps with uvicorn's 5 s default). Past ``CROWDED_CONNECTIONS`` open connections
idle ones go after ``CROWDED_KEEP_ALIVE_S`` instead, so idle clients cannot hold the
node's descriptors.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 310  # > the e2b SDK's 300 s pool idle timeout: the client closes first
CROWDED_CONNECTIONS = 2048
CROWDED_KEEP_ALIVE_S = 5  # uvicorn's default


class _HeadDeadlineH11(H11Protocol):
    head_timeout: float = 10.0
    _head_deadline: asyncio.TimerHandle | None = None
    _idle_between = False  # kept alive after a response, no byte of the next head yet

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
        # The next request on this connection, unless a pipelined one already started:
        # its head's deadline starts with its first byte (idle until then, as long as
        # the keep-alive timeout allows).
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._waiting_cycle = self.cycle
            self._idle_between = True
            if len(self.server_state.connections) > CROWDED_CONNECTIONS and \
                    self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = self.loop.call_later(
                    CROWDED_KEEP_ALIVE_S, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._idle_between:
            self._idle_between = False
            self._arm_head_deadline()
        super().data_received(data)

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
        # Idle keep-alive connections outlive the clients' pools (see the module's doc).
        "timeout_keep_alive": KEEP_ALIVE_S,
        # No limit_concurrency: it answers 503 to everyone once slow clients hold
        # that many connections, which is exactly the starvation to avoid.
    }
