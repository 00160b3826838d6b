"""HTTP pieces the node's API and the cluster's gateway share: relaying requests and
WebSockets to an upstream safely, and errors in the API's JSON shape."""

from .relay import (
    DROP_REQUEST,
    DROP_RESPONSE,
    HOP_BY_HOP,
    ROUTING_HEADERS,
    SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER,
    BadTarget,
    client_host,
    connect_websocket,
    forwarded_headers,
    origin_form,
    relay_client,
    relay_http,
    relay_websocket,
    send_error,
    shared_tls,
    upstream_url,
)

__all__ = [
    "DROP_REQUEST",
    "DROP_RESPONSE",
    "HOP_BY_HOP",
    "ROUTING_HEADERS",
    "SANDBOX_ID_HEADER",
    "SANDBOX_PORT_HEADER",
    "BadTarget",
    "client_host",
    "connect_websocket",
    "forwarded_headers",
    "origin_form",
    "relay_client",
    "relay_http",
    "relay_websocket",
    "send_error",
    "shared_tls",
    "upstream_url",
]
