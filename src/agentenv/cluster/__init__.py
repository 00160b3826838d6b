"""Running agentenv as a cluster: scheduler, gateway, node heartbeats, peer transfer.

Cluster state lives in Redis (``registry``); the scheduler and the gateway are
clients of the nodes' HTTP API; snapshots live in the shared repository.
"""

from .node_registry import NodeStatus, Registry, SandboxEntry
from .placement import PlacementRequest, place

__all__ = ["NodeStatus", "PlacementRequest", "Registry", "SandboxEntry", "place"]
