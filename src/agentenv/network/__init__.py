"""Network slots for sandboxes: per-slot netns pair, veths, NAT, isolation, warm pool.

Every sandbox sees the same inside addresses (eth0 169.254.0.21/30, gateway
169.254.0.22), so a gVisor checkpoint restores into any slot; the host reaches
slot K at its own address through the slot's router netns.
"""

from .host import cleanup_all
from .policy import CompiledPolicy, EgressPolicy, PolicyError, compile_policy, parse_policy
from .pool import SlotPool, SlotPoolClosed, SlotPoolExhausted
from .slot import Slot, SlotError, SlotLayout

__all__ = [
    "CompiledPolicy",
    "EgressPolicy",
    "PolicyError",
    "Slot",
    "SlotError",
    "SlotLayout",
    "SlotPool",
    "SlotPoolClosed",
    "SlotPoolExhausted",
    "cleanup_all",
    "compile_policy",
    "parse_policy",
]
