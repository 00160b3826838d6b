"""Isolation engines behind one driver protocol (gVisor today)."""

from .base import Runtime, RuntimeFailure, RuntimeSandbox, SandboxSpec
from .gvisor import GVisorRuntime

__all__ = ["GVisorRuntime", "Runtime", "RuntimeFailure", "RuntimeSandbox", "SandboxSpec"]
