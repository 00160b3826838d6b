"""Cluster state in Redis: nodes, their liveness, and which node owns each sandbox.

Keys (under ``prefix``, default ``aenv:``):
- ``nodes``: set of every node ID ever registered;
- ``node:<id>``: the node's last heartbeat (JSON), plus ``state`` up/down;
- ``alive:<id>``: exists while the node's heartbeats keep coming (a TTL);
- ``reserved:<id>``: placements handed out since the node's last heartbeat;
- ``released:<id>``: sandboxes the gateway saw end or pause on the node since its
  last heartbeat (and placements whose create failed), so room freed between
  heartbeats is room at once;
- ``beat:<id>``: the number of the node's last heartbeat (a release counts only if
  no heartbeat came while it was made: that heartbeat may already show it);
- ``sbx:<id>``: hash ``node``, ``state``, ``snapshot``, ``committed``, ``item`` (how
  its node lists it, JSON: the gateway lists it so once the node is lost);
- ``node-sbx:<id>``: the sandbox IDs the node reported last.

Nothing lives only in a process: a gateway or scheduler restarted, or a second
one started, sees the same cluster.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from .common import NodeStatus as NodeStatus
from .common import SandboxEntry as SandboxEntry
from .redis_conn import REDIS_MAX_CONNECTIONS as REDIS_MAX_CONNECTIONS
from .redis_conn import connect

# sbx:<id> and, with the node it names, node:<n>, alive:<n>, reserved:<n>, released:<n>.
# The node keys are derived inside the script: fine on one Redis (not for Redis Cluster).
_ROUTE = """
local entry = redis.call('HGETALL', KEYS[1])
if #entry == 0 then return false end
local node = ''
for i = 1, #entry, 2 do if entry[i] == 'node' then node = entry[i + 1] end end
local p = ARGV[1]
return {entry, redis.call('GET', p .. 'node:' .. node),
        redis.call('EXISTS', p .. 'alive:' .. node), redis.call('GET', p .. 'reserved:' .. node),
        redis.call('GET', p .. 'released:' .. node)}
"""

# released:<n> += 1 if beat:<n> is still ARGV[1] (no heartbeat since the caller read it).
_RELEASE = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then return 0 end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""


def _entry(node_id: str, state: str, snapshot_id: str, committed: bool,
           item: dict[str, Any] | None) -> dict[str, str]:
    """A sandbox's ``sbx:<id>`` hash."""
    mapping = {"node": node_id, "state": state, "snapshot": snapshot_id,
               "committed": "1" if committed else "0"}
    if item:
        mapping["item"] = json.dumps(item)
    return mapping


class Registry:
    def __init__(self, url: str, prefix: str = "aenv:") -> None:
        # decode_responses: every answer is a str, which redis-py's types cannot say
        # (they give bytes | str), so the client is untyped here.
        self.redis: Any = connect(url)
        self.prefix = prefix
        # node ID -> (its heartbeat's number, its status as that heartbeat said): nodes().
        self._bodies: dict[str, tuple[str, NodeStatus]] = {}
        self._route = self.redis.register_script(_ROUTE)
        self._release = self.redis.register_script(_RELEASE)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # -- nodes ------------------------------------------------------------------

    async def heartbeat(self, status: NodeStatus, ttl_ms: int) -> tuple[list[str], bool]:
        """Record a heartbeat: the node is up for ``ttl_ms`` more, and owns what it lists.
        Returns the paused sandboxes it lists that another up node has taken over
        (the node drops its stale records of them), and whether the node was down (or
        new) until this heartbeat."""
        status.state, status.last_seen, status.reserved, status.released = "up", time.time(), 0, 0
        body = status.to_dict()
        body.pop("sandboxes")
        nid = status.node_id
        reported = {s.sandbox_id: s for s in status.sandboxes}
        previous = await self.redis.smembers(self._k("node-sbx", nid))
        pipe = self.redis.pipeline()
        pipe.exists(self._k("alive", nid))
        pipe.sadd(self._k("nodes"), nid)
        pipe.set(self._k("node", nid), json.dumps(body))
        pipe.set(self._k("alive", nid), "1", px=ttl_ms)
        pipe.delete(self._k("reserved", nid))
        pipe.delete(self._k("released", nid))
        pipe.incr(self._k("beat", nid))
        pipe.delete(self._k("node-sbx", nid))
        if reported:
            pipe.sadd(self._k("node-sbx", nid), *reported)
        was_alive, *_ = await pipe.execute()
        # A round trip per step, not per sandbox: a node holds hundreds of them.
        sids = list(reported)
        owners = await self._each(lambda p: [p.hget(self._k("sbx", sid), "node") for sid in sids])
        others = sorted({o for o in owners if o and o != nid})
        alive = await self._each(lambda p: [p.exists(self._k("alive", o)) for o in others])
        up = {o for o, a in zip(others, alive, strict=True) if a}
        disown = []
        writes = self.redis.pipeline(transaction=False)
        for entry, owner in zip(reported.values(), owners, strict=True):
            # A sandbox another live node has taken over (from its last pause, this
            # node being lost meanwhile) stays with that node: this one drops its copy.
            if owner and owner != nid and owner in up:
                if entry.state in ("paused", "running"):
                    disown.append(entry.sandbox_id)
                continue
            writes.hset(self._k("sbx", entry.sandbox_id),
                        mapping=_entry(nid, entry.state, entry.snapshot_id, entry.committed,
                                       entry.item))
        gone = sorted(previous - set(reported))
        gone_owners = await self._each(lambda p: [p.hget(self._k("sbx", sid), "node")
                                                  for sid in gone])
        for sid, owner in zip(gone, gone_owners, strict=True):
            if owner == nid:
                writes.delete(self._k("sbx", sid))
        await writes.execute()
        return disown, not was_alive

    async def _each(self, queue: Callable[[Any], list[Any]]) -> list[Any]:
        """The answers of the commands ``queue`` puts on a pipeline, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        if not queue(pipe):
            return []
        return list(await pipe.execute())

    async def is_up(self, node_id: str) -> bool:
        return bool(await self.redis.exists(self._k("alive", node_id)))

    async def node(self, node_id: str) -> NodeStatus | None:
        raw = await self.redis.get(self._k("node", node_id))
        if raw is None:
            return None
        status = NodeStatus.from_dict(json.loads(raw))
        pipe = self.redis.pipeline()
        pipe.exists(self._k("alive", node_id))
        pipe.get(self._k("reserved", node_id))
        pipe.get(self._k("released", node_id))
        alive, reserved, released = await pipe.execute()
        status.state = "up" if alive else "down"
        status.reserved = int(reserved or 0)
        status.released = int(released or 0)
        return status

    async def nodes(self) -> list[NodeStatus]:
        """Every registered node, with its liveness and the counts of room taken and
        freed since its heartbeat, as of one moment (MULTI: no heartbeat lands halfway).

        Every placement reads every node, so a node's body (its heartbeat, ~0.5 KB) is
        read only when its heartbeat number changed since this process last read it;
        otherwise the small counts alone. A body read just after a new heartbeat may be
        newer than the counts read with it: its room is undercounted for that read only.
        """
        ids = sorted(await self.redis.smembers(self._k("nodes")))
        pipe = self.redis.pipeline()
        for nid in ids:
            pipe.get(self._k("beat", nid))
            pipe.exists(self._k("alive", nid))
            pipe.get(self._k("reserved", nid))
            pipe.get(self._k("released", nid))
        flat = await pipe.execute() if ids else []
        counts = {nid: flat[4 * i:4 * i + 4] for i, nid in enumerate(ids)}
        stale = [nid for nid in ids
                 if nid not in self._bodies or self._bodies[nid][0] != (counts[nid][0] or "0")]
        bodies = await self._each(lambda p: [p.get(self._k("node", nid)) for nid in stale])
        for nid, raw in zip(stale, bodies, strict=True):
            if raw is None:
                self._bodies.pop(nid, None)
            else:
                self._bodies[nid] = (counts[nid][0] or "0",
                                     NodeStatus.from_dict(json.loads(raw)))
        for nid in set(self._bodies) - set(ids):
            del self._bodies[nid]  # forgotten
        out = []
        for nid in ids:
            if nid not in self._bodies:
                continue
            _, alive, reserved, released = counts[nid]
            status = dataclasses.replace(self._bodies[nid][1])
            status.state = "up" if alive else "down"
            status.reserved = int(reserved or 0)
            status.released = int(released or 0)
            out.append(status)
        return out

    async def mark_down(self, node_id: str) -> bool:
        """Record that a node stopped heartbeating; True if this call made the change."""
        key = self._k("node", node_id)
        raw = await self.redis.get(key)
        if raw is None:
            return False
        body = json.loads(raw)
        if body.get("state") == "down":
            return False
        body["state"] = "down"
        await self.redis.set(key, json.dumps(body))
        return True

    async def reserve(self, node_id: str, ttl_ms: int) -> str:
        """Count a placement against a node until its next heartbeat reports it;
        the heartbeat's number then (a create that fails hands the room back with
        ``release``)."""
        pipe = self.redis.pipeline()  # MULTI: the beat is the one the count is under
        pipe.incr(self._k("reserved", node_id))
        pipe.pexpire(self._k("reserved", node_id), ttl_ms)
        pipe.get(self._k("beat", node_id))
        *_, beat = await pipe.execute()
        return str(beat or "0")

    async def beat(self, node_id: str) -> str:
        """The number of the node's last heartbeat (read before a delete or a create
        whose freed room ``release`` is to count)."""
        return str(await self.redis.get(self._k("beat", node_id)) or "0")

    async def release(self, node_id: str, beat: str, ttl_ms: int) -> bool:
        """Count a sandbox slot freed on the node (a kill, a pause, a create that
        failed) until its next heartbeat; not if a heartbeat came since ``beat`` was
        read (it may count the freed slot already: counting it twice would send
        creates to a full node). True if counted."""
        return bool(await self._release(
            keys=[self._k("beat", node_id), self._k("released", node_id)],
            args=[beat, ttl_ms]))

    async def forget_node(self, node_id: str) -> None:
        await self.redis.srem(self._k("nodes"), node_id)
        await self.redis.delete(self._k("node", node_id), self._k("alive", node_id))

    # -- sandboxes ----------------------------------------------------------------

    async def set_sandbox(self, sandbox_id: str, node_id: str, state: str,
                          snapshot_id: str = "", committed: bool = False,
                          item: dict[str, Any] | None = None) -> None:
        await self.redis.hset(self._k("sbx", sandbox_id),
                              mapping=_entry(node_id, state, snapshot_id, committed, item))

    async def lost(self) -> list[tuple[dict[str, str], NodeStatus]]:
        """The sandboxes of nodes that are down (past their heartbeat TTL), as their
        node last reported them, that no other node has taken over."""
        out = []
        for node in await self.nodes():
            if node.state != "down":
                continue
            for sid in sorted(await self.redis.smembers(self._k("node-sbx", node.node_id))):
                entry = await self.sandbox(sid)
                if entry and entry.get("node") == node.node_id:
                    out.append(({"sandboxID": sid, **entry}, node))
        return out

    async def sandbox(self, sandbox_id: str) -> dict[str, str] | None:
        data = await self.redis.hgetall(self._k("sbx", sandbox_id))
        return data or None

    async def route(self, sandbox_id: str) -> tuple[dict[str, str], NodeStatus | None] | None:
        """A sandbox's entry and its node's status in one round trip (every proxied
        request asks this); None when no node owns the sandbox."""
        reply = await self._route(keys=[self._k("sbx", sandbox_id)], args=[self.prefix])
        if not reply:
            return None
        flat, body, alive, reserved, released = reply
        entry = dict(zip(flat[::2], flat[1::2], strict=True))
        if not body:
            return entry, None
        status = NodeStatus.from_dict(json.loads(body))
        status.state = "up" if alive else "down"
        status.reserved = int(reserved or 0)
        status.released = int(released or 0)
        return entry, status

    async def forget_sandbox(self, sandbox_id: str) -> None:
        await self.redis.delete(self._k("sbx", sandbox_id))

    # -- runs (the node each lives on; leases are at most a day) ------------------

    async def set_run(self, run_id: str, node_id: str) -> None:
        await self.redis.set(self._k("run", run_id), node_id, ex=2 * 86400)

    async def run_node(self, run_id: str) -> str | None:
        return await self.redis.get(self._k("run", run_id))

    async def forget_run(self, run_id: str) -> None:
        await self.redis.delete(self._k("run", run_id))
