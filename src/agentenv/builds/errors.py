"""The builder's exceptions: a request it refuses, and a build step that failed."""

from __future__ import annotations

from ..errors import AgentenvError


class BuildError(AgentenvError):
    """A request the builder refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class StepFailed(Exception):
    """A build failed in ``step`` (a step's number, ``base`` or ``finalize``)."""

    def __init__(self, message: str, step: str):
        super().__init__(message)
        self.step = step
