"""Helpers for running real agentenv servers in tests and benchmarks."""

from .nodes import SHARED_HOME, Node, free_cidr, free_port, leaks, sdk_env, serving

__all__ = ["SHARED_HOME", "Node", "free_cidr", "free_port", "leaks", "sdk_env", "serving"]
