"""Template routes through the gateway: a build lives on the node that started it.

A build's status, logs, context uploads and start, and the template's own routes
(details, tags, delete), go to the node the template was created on (``tpl:<id>``
in Redis, kept from the answer of a create); every other node has at most a copy
fetched from the shared repository. Templates of a node that is down, and those
the gateway never saw created, go to any node.
"""

from __future__ import annotations

import re

import httpx

from .node_registry import NodeStatus, Registry

# /templates/<id>..., /v2/templates/<id>..., /v3/templates/<id>... (an ID or a name,
# with a tag perhaps); a create is /templates, /v2/templates or /v3/templates.
_SCOPED = re.compile(r"^/(?:v\d+/)?templates/([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?::[^/]*)?"
                     r"(?:/.*)?$")
_CREATE = re.compile(r"^/(?:v\d+/)?templates/?$")
# How long the gateway remembers where a template was created (a build's routes
# are used for minutes; a template's own for as long as it lives).
TEMPLATE_TTL_S = 30 * 86400


def template_of(path: str) -> str | None:
    """The template a path is scoped to (None: not a template's route)."""
    m = _SCOPED.match(path)
    return m.group(1) if m and m.group(1) not in ("tags", "aliases") else None


async def home_node(registry: Registry, path: str) -> NodeStatus | None:
    """The up node a template route goes to, if the gateway knows one."""
    template = template_of(path)
    if template is None:
        return None
    node_id = await registry.redis.get(registry._k("tpl", template))
    if not node_id:
        return None
    node = await registry.node(node_id)
    return node if node is not None and node.state == "up" else None


async def remember(registry: Registry, method: str, path: str, node: NodeStatus,
                   r: httpx.Response) -> None:
    """After a node answered: a template created there lives there."""
    if method != "POST" or not _CREATE.match(path) or not 200 <= r.status_code < 300:
        return
    try:
        body = r.json()
    except ValueError:
        return
    template = body.get("templateID") if isinstance(body, dict) else None
    if isinstance(template, str) and template_of(f"/templates/{template}") == template:
        pipe = registry.redis.pipeline()
        pipe.set(registry._k("tpl", template), node.node_id, ex=TEMPLATE_TTL_S)
        for alias in body.get("aliases") or body.get("names") or []:
            if isinstance(alias, str) and template_of(f"/templates/{alias}") == alias:
                pipe.set(registry._k("tpl", alias), node.node_id, ex=TEMPLATE_TTL_S)
        await pipe.execute()
