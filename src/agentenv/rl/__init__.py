"""agentenv's RL client: a pool of environments for rollouts, over HTTP only.

``EnvPool`` keeps N sandboxes of a template or snapshot, hands them out to rollouts,
resets them between rollouts (in place where the node can), retries as the server
asks, and holds a run lease so a crashed trainer leaks nothing. See ``pool``.
"""

from .envd import EnvdError, ExecResult, ExecTimeout
from .http import ApiError, RetryPolicy
from .pool import Env, EnvPool, timed

__all__ = ["ApiError", "Env", "EnvPool", "EnvdError", "ExecResult", "ExecTimeout",
           "RetryPolicy", "timed"]
