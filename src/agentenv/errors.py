"""The error family: every error the node or the gateway answers with a status of its
own derives from ``AgentenvError`` and carries that status. ``agentenv.web.errors``
maps them to ``{"code": <status>, "message": "..."}`` in one place: the status and the
message's prefix are the class's, so no route maps errors of its own."""

from __future__ import annotations


class AgentenvError(Exception):
    """An error a client is told about, with the HTTP status it is answered with."""

    status: int = 500
    # Said before the error's own message in the answer (what failed, when the
    # message alone does not say it), e.g. "snapshot repository unavailable".
    message_prefix: str = ""
    # Headers the answer carries (e.g. Retry-After of a 429).
    headers: dict[str, str] | None = None
