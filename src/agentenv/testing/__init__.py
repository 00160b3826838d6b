"""Helpers for running real agentenv servers in tests and benchmarks."""

from .nodes import SHARED_HOME, Node, free_cidr, leaks, sdk_env, serving
from .ports import listening_port, listening_socket, start_redis

__all__ = ["SHARED_HOME", "Node", "free_cidr", "leaks", "listening_port", "listening_socket",
           "sdk_env", "serving", "start_redis"]
