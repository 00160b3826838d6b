"""Cluster state in Redis: nodes, their liveness, and which node owns each sandbox.

Keys (under ``prefix``, default ``aenv:``):
- ``nodes``: set of every node ID ever registered;
- ``node:<id>``: the node's last heartbeat (JSON), plus ``state`` up/down;
- ``alive:<id>``: exists while the node's heartbeats keep coming (a TTL);
- ``reserved:<id>``: placements handed out since the node's last heartbeat;
- ``released:<id>``: placements whose create failed since the node's last heartbeat
  (their room again);
- ``freed:<id>``: sandboxes the gateway saw end or pause on the node that its
  heartbeats still count as running (a heartbeat taken before the kill or pause
  finished), and ``freed-n:<id>`` their number: room freed between heartbeats is room
  at once, and stays counted until a heartbeat no longer counts the sandbox;
- ``room:<id>``: the sandboxes the node had room for at its last heartbeat
  (capacity less load): a placement reserves against it atomically (``reserve_room``),
  so schedulers placing from views a moment old never overfill a node;
- ``beat:<id>``: the number of the node's last heartbeat (a failed create's release
  counts only if no heartbeat came since its placement: that heartbeat reset
  ``reserved:<id>``);
- ``sbx:<id>``: hash ``node``, ``state``, ``snapshot``, ``committed``, ``key`` (the
  caller key ID that made it through a gateway, when a quota counts it), ``item`` (how
  its node lists it, JSON: the gateway lists it so once the node is lost);
- ``key-run:<key ID>``: a caller key's running sandboxes and creates under way
  (``quotas.py``; ``sbx:<id>``'s ``key`` names the key);
- ``down``: the nodes the sweeper marked down since their last heartbeat (listings
  show their sandboxes as lost: ``lost.py``);
- ``lst:*``: the listings' indexes (``sandbox_index.py``), moved with each write of
  ``sbx:<id>`` (its field ``ix`` says where it is indexed);
- ``node-fp:<id>``: hash, each sandbox ID the node lists -> the fingerprint of its
  entry (state, snapshot, listing) when it was last written; ``sbx:<id>``'s ``fp`` is
  the fingerprint of the heartbeat that wrote it (empty when the gateway did): a
  heartbeat rewrites only the records that differ from what it says;
- ``hb:<id>``: hash, the node process's ``session``, the ``seq`` of its heartbeat last
  applied, the ``diffs`` applied since its last full one, and the ``token`` of the
  scheduler request that claimed it last (``heartbeat``: a node sends only what changed
  since the beat last applied; ``beats.py``).

Nothing lives only in a process: a gateway or scheduler restarted, or a second
one started, sees the same cluster.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from . import registry_scripts as scripts
from .beats import Beat
from .common import NodeStatus as NodeStatus
from .common import SandboxEntry as SandboxEntry
from .heartbeat_writes import COUNTED_STATES as COUNTED_STATES
from .heartbeat_writes import FULL_CHECK_EVERY as FULL_CHECK_EVERY
from .heartbeat_writes import Applied as Applied
from .heartbeat_writes import Commands, HeartbeatWriter, record_mapping
from .redis_conn import REDIS_MAX_CONNECTIONS as REDIS_MAX_CONNECTIONS
from .redis_conn import connect, pipelined
from .sandbox_index import RUN_METADATA, Indexed, Keys, indexed, move, pair_hash, split

MAX_RUN_MEMBERS = 10_000  # a run's sandboxes dropped from the listings when it ends
# How long a sandbox the gateway forgot (killed through it) is not written back by a
# heartbeat: one sent before the kill and read after it would list it again.
FORGOTTEN_MS = 60_000
CHANGE_TRIES = 5  # a record changed under the gateway's write: read again


class Registry:
    def __init__(self, url: str, prefix: str = "aenv:") -> None:
        # decode_responses: every answer is a str, which redis-py's types cannot say
        # (they give bytes | str), so the client is untyped here.
        self.redis: Any = connect(url)
        self.prefix = prefix
        # node ID -> (its heartbeat's number, its status as that heartbeat said): nodes().
        self._bodies: dict[str, tuple[str, NodeStatus]] = {}
        self._route = self.redis.register_script(scripts.ROUTE)
        self._release = self.redis.register_script(scripts.RELEASE)
        self._reserve_room = self.redis.register_script(scripts.RESERVE_ROOM)
        self._free = self.redis.register_script(scripts.FREE)
        self._take = self.redis.register_script(scripts.TAKE)
        self._guarded = self.redis.register_script(scripts.GUARDED)
        self.index = Keys(prefix)
        self.heartbeats = HeartbeatWriter(self.redis, prefix, self.index)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # -- nodes ------------------------------------------------------------------

    async def heartbeat(self, status: NodeStatus, ttl_ms: int, beat: Beat | None = None
                        ) -> Applied:
        """Record a node's heartbeat (``heartbeat_writes.HeartbeatWriter.apply``)."""
        return await self.heartbeats.apply(status, ttl_ms, beat)

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
        pipe.get(self._k("freed-n", node_id))
        alive, reserved, released, freed = await pipe.execute()
        status.state = "up" if alive else "down"
        status.reserved = int(reserved or 0)
        status.released = int(released or 0) + int(freed or 0)
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
        if not ids:
            self._bodies.clear()
            return []
        # Five MGETs whatever the number of nodes (one command each, not one per node).
        pipe = self.redis.pipeline()
        for kind in ("beat", "alive", "reserved", "released", "freed-n"):
            pipe.mget([self._k(kind, nid) for nid in ids])
        beats, alives, reserveds, releaseds, freeds = await pipe.execute()
        counts = {nid: (beats[i], alives[i], reserveds[i],
                        int(releaseds[i] or 0) + int(freeds[i] or 0))
                  for i, nid in enumerate(ids)}
        stale = [nid for nid in ids
                 if nid not in self._bodies or self._bodies[nid][0] != (counts[nid][0] or "0")]
        bodies = await self.redis.mget([self._k("node", nid) for nid in stale]) \
            if stale else []
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
            status.released = released
            out.append(status)
        return out

    async def mark_down(self, node_id: str) -> bool:
        """Record that a node stopped heartbeating; True if this call made the change.
        A node this process saw marked down since its last heartbeat is not read again
        (the sweeper asks of every down node, every sweep)."""
        cached = self._bodies.get(node_id)
        if cached is not None and cached[1].state == "down":
            return False
        key = self._k("node", node_id)
        raw = await self.redis.get(key)
        if raw is None:
            return False
        body = json.loads(raw)
        made = body.get("state") != "down"
        if made:
            body["state"] = "down"
            await self.redis.set(key, json.dumps(body))
        await self.redis.sadd(self._k("down"), node_id)
        if cached is not None:
            cached[1].state = "down"  # until a heartbeat (a new number) is read
        return made

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

    async def reserve_room(self, node_id: str, ttl_ms: int) -> str | None:
        """``reserve`` if the node has room as Redis counts it (its last heartbeat's
        room less what was placed there since, plus what was freed): the heartbeat's
        number, or None when another placement took the last of it."""
        beat = await self._reserve_room(
            keys=[self._k("room", node_id), self._k("reserved", node_id),
                  self._k("released", node_id), self._k("beat", node_id),
                  self._k("freed-n", node_id)],
            args=[ttl_ms])
        return None if beat is None else str(beat)

    async def beat(self, node_id: str) -> str:
        """The number of the node's last heartbeat."""
        return str(await self.redis.get(self._k("beat", node_id)) or "0")

    async def free(self, node_id: str, sandbox_id: str, ttl_ms: int) -> None:
        """A running sandbox of the node ended or paused (through the gateway): its slot
        is room until a heartbeat no longer counts it as running (one taken before the
        kill or pause finished still does; counting it then too would overfill the
        node, and waiting for the next one would refuse creates meanwhile)."""
        await self._free(keys=[self._k("freed", node_id), self._k("freed-n", node_id)],
                         args=[sandbox_id, ttl_ms])

    async def take(self, node_id: str, sandbox_id: str, ttl_ms: int) -> None:
        """A paused sandbox of the node runs again (a resume through the gateway)."""
        await self._take(keys=[self._k("freed", node_id), self._k("freed-n", node_id),
                               self._k("reserved", node_id)],
                         args=[sandbox_id, ttl_ms])

    async def release(self, node_id: str, beat: str, ttl_ms: int) -> bool:
        """Hand back the slot of a placement whose create failed, until the node's next
        heartbeat; not if a heartbeat came since the placement (``beat``, its number
        then: that heartbeat reset the placement's count). True if counted."""
        return bool(await self._release(
            keys=[self._k("beat", node_id), self._k("released", node_id)],
            args=[beat, ttl_ms]))

    async def forget_node(self, node_id: str) -> None:
        await self.redis.srem(self._k("nodes"), node_id)
        await self.redis.srem(self._k("down"), node_id)
        await self.redis.delete(self._k("node", node_id), self._k("alive", node_id),
                                self._k("room", node_id), self._k("node-fp", node_id),
                                self._k("hb", node_id),
                                self._k("freed", node_id), self._k("freed-n", node_id))

    # -- sandboxes ----------------------------------------------------------------

    async def set_sandbox(self, sandbox_id: str, node_id: str, state: str,
                          snapshot_id: str = "", committed: bool = False,
                          item: dict[str, Any] | None = None) -> None:
        """Record a sandbox's node and state (and listing item: from a create's answer),
        moving it in the listings' indexes."""
        raw_item = json.dumps(item) if item else ""

        def change(old: Indexed | None, commands: Commands) -> None:
            new = indexed(sandbox_id, state, item, old)
            mapping = record_mapping(node_id, state, snapshot_id, committed, raw_item)
            if new is not None:
                mapping["ix"] = new.dump()
            commands.hset(self._k("sbx", sandbox_id), mapping=mapping)
            move(commands, self.index, old, new)
        await self._change(sandbox_id, change)

    async def _change(self, sandbox_id: str,
                      change: Callable[[Indexed | None, Commands], None]) -> None:
        """The gateway's change of a sandbox's record (``change``: the commands, from
        where the record was indexed), written only over the record as read: a
        heartbeat's writes between the read and the write would leave index entries of
        a state it no longer has. Read again and retried; the last try writes whatever
        is there (what the gateway writes is what its node answered)."""
        key = self._k("sbx", sandbox_id)
        for attempt in range(CHANGE_TRIES):
            owner, was, raw = await self.redis.hmget(key, "node", "state", "ix")
            read = {"node": owner or "", "state": was or "", "ix": raw or ""} \
                if attempt < CHANGE_TRIES - 1 else {}
            commands = Commands()
            with commands.guard(key, **read):
                change(Indexed.load(raw), commands)
            if not int(await self._guarded(args=[json.dumps(commands.list)])):
                return

    async def down_nodes(self) -> list[NodeStatus]:
        """The nodes marked down (past their heartbeat TTL, as the sweeper saw), read
        without reading the others."""
        ids = sorted(await self.redis.smembers(self._k("down")))
        if not ids:
            return []
        # A heartbeat may have come since the sweeper's mark: alive wins.
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([self._k("node", n) for n in ids])
        pipe.mget([self._k("alive", n) for n in ids])
        bodies, alive = await pipe.execute()
        out = []
        for raw, up in zip(bodies, alive, strict=True):
            if raw is not None and not up:
                status = NodeStatus.from_dict(json.loads(raw))
                status.state = "down"
                out.append(status)
        return out

    async def lost(self, down: list[NodeStatus] | None = None
                   ) -> list[tuple[dict[str, str], NodeStatus]]:
        """The sandboxes of nodes that are down (past their heartbeat TTL; ``down``:
        as just read), as their node last reported them, that no other node has
        taken over."""
        down = await self.down_nodes() if down is None else down
        # Two round trips whatever the number of lost sandboxes: their IDs, then entries.
        members = await pipelined(
            self.redis, lambda p: [p.hkeys(self._k("node-fp", n.node_id)) for n in down])
        owned = [(sid, node) for node, sids in zip(down, members, strict=True)
                 for sid in sorted(sids)]
        entries = await pipelined(
            self.redis, lambda p: [p.hgetall(self._k("sbx", sid)) for sid, _ in owned])
        return [({"sandboxID": sid, **entry}, node)
                for (sid, node), entry in zip(owned, entries, strict=True)
                if entry and entry.get("node") == node.node_id]

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
        """The sandbox ended (killed through the gateway): out of the listings, and
        not written back by a heartbeat its node sent before the kill."""
        def change(old: Indexed | None, commands: Commands) -> None:
            commands.delete(self._k("sbx", sandbox_id))
            commands.set(self._k("forgotten", sandbox_id), "1", px=FORGOTTEN_MS)
            move(commands, self.index, old, None)
        await self._change(sandbox_id, change)

    # -- runs (the node each lives on; leases are at most a day) ------------------

    async def set_run(self, run_id: str, node_id: str) -> None:
        await self.redis.set(self._k("run", run_id), node_id, ex=2 * 86400)

    async def run_node(self, run_id: str) -> str | None:
        return await self.redis.get(self._k("run", run_id))

    async def forget_run(self, run_id: str) -> None:
        """The run ended through this gateway, and its node killed its sandboxes: they
        leave the listings now, not at the node's next heartbeat."""
        await self.redis.delete(self._k("run", run_id))
        key = self.index.pair(pair_hash(RUN_METADATA, run_id))
        members = await self.redis.zrange(key, 0, MAX_RUN_MEMBERS - 1)
        for m in members:
            await self.forget_sandbox(split(m)[1])
        if members:  # an entry indexed without its record is gone too
            await self.redis.zrem(key, *members)
