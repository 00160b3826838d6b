"""agentenv: isolated, snapshot-able Linux sandboxes for agentic RL, E2B-compatible."""

__version__ = "0.1.0"
