"""Running agentenv as a cluster: scheduler, gateway, node heartbeats, peer transfer.

Cluster state lives in Redis (``registry``); the scheduler and the gateway are
clients of the nodes' HTTP API; snapshots live in the shared repository.

Names are imported on first use: a node importing ``cluster.common`` (what it
heartbeats) does not load the Redis client.
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .common import NodeStatus, SandboxEntry
    from .node_registry import Registry
    from .placement import PlacementRequest, place

__getattr__ = lazy_exports(__name__, {
    "NodeStatus": "common", "SandboxEntry": "common", "Registry": "node_registry",
    "PlacementRequest": "placement", "place": "placement",
})

__all__ = ["NodeStatus", "PlacementRequest", "Registry", "SandboxEntry", "place"]
