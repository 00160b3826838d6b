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
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from . import registry_scripts as scripts
from .beats import MAX_ITEM_BYTES, Beat
from .common import ClusterError
from .common import NodeStatus as NodeStatus
from .common import SandboxEntry as SandboxEntry
from .redis_conn import REDIS_MAX_CONNECTIONS as REDIS_MAX_CONNECTIONS
from .redis_conn import connect
from .sandbox_index import RUN_METADATA, Indexed, Keys, indexed, move, pair_hash, split

MAX_RUN_MEMBERS = 10_000  # a run's sandboxes dropped from the listings when it ends
# The states a node's load counts (``active_count``): a sandbox freed through the
# gateway stays freed room while a heartbeat still reports it in one of them.
COUNTED_STATES = frozenset({"creating", "running"})



# A node's heartbeat is whole this often (the others are diffs): every record of its
# sandboxes is checked then (an owner moved while the node was up, a record lost).
FULL_CHECK_EVERY = 20

# How long a sandbox the gateway forgot (killed through it) is not written back by a
# heartbeat: one sent before the kill and read after it would list it again.
FORGOTTEN_MS = 60_000


def _entry(node_id: str, state: str, snapshot_id: str, committed: bool,
           item: str) -> dict[str, str]:
    """A sandbox's ``sbx:<id>`` hash (``item``: as JSON, or empty); its ``fp`` says
    which heartbeat wrote it, empty when the gateway did."""
    mapping = {"node": node_id, "state": state, "snapshot": snapshot_id,
               "committed": "1" if committed else "0", "fp": ""}
    if item:
        mapping["item"] = item
    return mapping


class _Written:
    """A heartbeat's sandbox entry as the registry writes it: its item serialized once
    (and bounded), and its fingerprint (state, snapshot, item)."""

    __slots__ = ("committed", "fp", "item", "raw_item", "snapshot_id", "state")

    def __init__(self, entry: SandboxEntry) -> None:
        self.state, self.snapshot_id = entry.state, entry.snapshot_id
        self.committed, self.item = entry.committed, entry.item
        self.raw_item = json.dumps(entry.item, separators=(",", ":"), default=str) \
            if entry.item else ""
        if len(self.raw_item) > MAX_ITEM_BYTES:
            raise ClusterError(413, f"sandbox {entry.sandbox_id}'s listing item exceeds "
                                    f"{MAX_ITEM_BYTES} bytes")
        raw = "\0".join((self.state, self.snapshot_id, "1" if self.committed else "0",
                          self.raw_item))
        self.fp = hashlib.sha1(raw.encode()).hexdigest()[:16]

    def mapping(self, node_id: str) -> dict[str, str]:
        mapping = _entry(node_id, self.state, self.snapshot_id, self.committed,
                         self.raw_item)
        mapping["fp"] = self.fp
        return mapping


class Commands:
    """Redis commands queued as a pipeline's methods queue them (the few a heartbeat's
    writes use), to run in one script (``registry_scripts.APPLY``). Long ones are cut
    (a Lua call takes some thousands of arguments at most)."""

    CHUNK = 1000

    def __init__(self) -> None:
        self.list: list[list[Any]] = []

    def _cut(self, head: list[Any], items: list[Any], width: int = 1) -> None:
        step = self.CHUNK * width
        for i in range(0, len(items), step):
            self.list.append(head + items[i:i + step])

    def hset(self, key: str, mapping: dict[str, Any]) -> None:
        self._cut(["HSET", key], [x for kv in mapping.items() for x in kv], 2)

    def hdel(self, key: str, *fields: str) -> None:
        self._cut(["HDEL", key], list(fields))

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self._cut(["ZADD", key], [x for m, score in mapping.items() for x in (score, m)], 2)

    def zrem(self, key: str, *members: str) -> None:
        self._cut(["ZREM", key], list(members))

    def delete(self, *keys: str) -> None:
        self._cut(["DEL"], list(keys))

    def settle(self, freed: str, count: str, sandbox_ids: list[str]) -> None:
        """``sandbox_ids`` out of the set ``freed``, ``count`` less those that were in it."""
        self._cut(["SETTLE", freed, count], list(sandbox_ids))


class Applied(NamedTuple):
    """What a heartbeat did: the sandboxes the node is to drop (another live node took
    them over), whether the node was down (or new) until it, whether the node is to
    send its next beat whole (a full check due, or this one refused), and whether this
    one was refused (nothing of it recorded: the node sends a full beat at once)."""

    disown: list[str]
    rejoined: bool
    full: bool
    refused: bool = False


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
        self._claim = self.redis.register_script(scripts.CLAIM)
        self._differing = self.redis.register_script(scripts.DIFFERING)
        self._apply = self.redis.register_script(scripts.APPLY)
        self.index = Keys(prefix)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # -- nodes ------------------------------------------------------------------

    async def heartbeat(self, status: NodeStatus, ttl_ms: int, beat: Beat | None = None
                        ) -> Applied:
        """Record a heartbeat (``beat``: its session, number and, for a diff, its base
        and the IDs gone; None: a full beat of an older node): the node is up for
        ``ttl_ms`` more, and owns what it lists. A full beat lists all of the node's
        sandboxes; a diff those changed since the beat it is against (``base``), which
        must be the beat last applied, else nothing is recorded and the answer asks
        for a full beat (``Applied.full``, as it does every FULL_CHECK_EVERY-th beat
        and after the node was down). Two beats of one node at once write one after
        the other, or the later claim wins and the earlier writes nothing."""
        beat = beat or Beat()
        status.state, status.last_seen, status.reserved, status.released = "up", time.time(), 0, 0
        nid = status.node_id
        token = secrets.token_hex(8)
        # The entries as the registry writes them, each item serialized once (its size
        # bounded here, where it is measured).
        reported = {s.sandbox_id: _Written(s) for s in status.sandboxes}
        claimed = await self._claim(
            keys=[self._k("hb", nid), self._k("node", nid), self._k("alive", nid),
                  self._k("room", nid), self._k("reserved", nid), self._k("released", nid),
                  self._k("beat", nid), self._k("down"), self._k("nodes")],
            args=[beat.session, beat.seq, "" if beat.full else beat.base, token,
                  json.dumps(status.to_dict(sandboxes=False)), ttl_ms,
                  max(status.capacity - status.load, 0), nid])
        if int(claimed[0]) < 0:
            return Applied([], False, True, True)
        was_alive, diffs = bool(claimed[0]), int(claimed[2])
        reads = self.redis.pipeline(transaction=False)
        reads.smembers(self._k("freed", nid))
        if beat.full:
            reads.hkeys(self._k("node-fp", nid))
        (freed, *previous) = await reads.execute()
        if beat.full:
            gone = sorted(set(previous[0]) - set(reported))
        else:
            gone = sorted(set(beat.removed) - set(reported))
        # One command for all of them (a node holds hundreds): the entries whose record
        # differs from them (a full beat's mostly do not), less those the gateway
        # killed since (their tombstone), with each one's node, the key that made it (a
        # cluster-wide quota's: quotas.py) and where it is indexed.
        args = [a for sid, e in reported.items() for a in (sid, e.fp)]
        rows = await self._differing(args=[self.prefix, nid, *args]) if args else []
        differ = [(sid, (owner or None, key or None, ix or None))
                  for sid, owner, key, ix in rows]
        # The node's list (node-fp:<n>) gains what it did not have, and what is written.
        listing = set(reported) - set(previous[0]) if beat.full else set(reported)
        listing.update(sid for sid, _ in differ)
        others = sorted({owner for _, (owner, _, _) in differ if owner and owner != nid})
        alive = await self._each(lambda p: [p.exists(self._k("alive", o)) for o in others])
        up = {o for o, a in zip(others, alive, strict=True) if a}
        gone_found = await self._each(lambda p: [p.hmget(self._k("sbx", sid), "node", "key",
                                                          "ix") for sid in gone])
        # Freed through the gateway, and this heartbeat no longer counts them: its load
        # has their room now. A diff that does not mention one leaves it as the beat it
        # is against had it: still counted if that one listed it.
        if freed and not beat.full:
            unmentioned = [sid for sid in freed if sid not in reported and sid not in gone]
            listed = await self._each(lambda p: [p.hexists(self._k("node-fp", nid), sid)
                                                 for sid in unmentioned])
            still = {sid for sid, was in zip(unmentioned, listed, strict=True) if was}
        else:
            still = set()
        settled = [sid for sid in freed if sid not in still and (
            sid not in reported or reported[sid].state not in COUNTED_STATES)]

        disown: list[str] = []

        def writes(pipe: Commands) -> None:
            for sid, (owner, key, ix) in differ:
                entry = reported[sid]
                # A sandbox another live node has taken over (from its last pause, this
                # node being lost meanwhile) stays with that node: this one drops its copy.
                if owner and owner != nid and owner in up:
                    if entry.state in ("paused", "running"):
                        disown.append(sid)
                    continue
                mapping = entry.mapping(nid)
                old = Indexed.load(ix)
                new = indexed(sid, entry.state, entry.item, old)
                move(pipe, self.index, old, new)
                if new is not None:
                    mapping["ix"] = new.dump()
                pipe.hset(self._k("sbx", sid), mapping=mapping)
                if key and entry.state == "running":
                    pipe.zadd(self._k("key-run", key), {sid: 0})
                elif key:  # paused (or on its way): it holds none of its key's quota
                    pipe.zrem(self._k("key-run", key), sid)
            for sid, (owner, key, ix) in zip(gone, gone_found, strict=True):
                if owner == nid:
                    pipe.delete(self._k("sbx", sid))
                    move(pipe, self.index, Indexed.load(ix), None)
                    if key:  # ended on its node (a timeout): its key's room again
                        pipe.zrem(self._k("key-run", key), sid)
            # What the node lists (a disowned one is not: checked again while the node
            # still lists it).
            if gone:
                pipe.hdel(self._k("node-fp", nid), *gone)
            prints = {sid: reported[sid].fp for sid in listing if sid not in disown}
            if prints:
                pipe.hset(self._k("node-fp", nid), mapping=prints)
            if disown:
                pipe.hdel(self._k("node-fp", nid), *disown)
            if settled:
                pipe.settle(self._k("freed", nid), self._k("freed-n", nid), settled)

        if (differ or gone or reported or settled) and not await self._fenced(nid, token,
                                                                                 writes):
            return Applied([], not was_alive, True, True)  # a later beat claimed the node
        return Applied(disown, not was_alive, diffs >= FULL_CHECK_EVERY - 1)

    async def _fenced(self, node_id: str, token: str, queue: Callable[[Commands], None]
                      ) -> bool:
        """Run what ``queue`` puts on a ``Commands`` at once if the heartbeat that claimed
        the node with ``token`` is still its last claim; False (nothing written) once a
        later beat of the node claimed it: two beats' writes never interleave."""
        commands = Commands()
        queue(commands)
        return bool(await self._apply(keys=[self._k("hb", node_id)],
                                      args=[token, json.dumps(commands.list)]))

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
        old = Indexed.load(await self.redis.hget(self._k("sbx", sandbox_id), "ix"))
        new = indexed(sandbox_id, state, item, old)
        mapping = _entry(node_id, state, snapshot_id, committed,
                         json.dumps(item) if item else "")
        if new is not None:
            mapping["ix"] = new.dump()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self._k("sbx", sandbox_id), mapping=mapping)
        move(pipe, self.index, old, new)
        await pipe.execute()

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
        members = await self._each(lambda p: [p.hkeys(self._k("node-fp", n.node_id))
                                              for n in down])
        owned = [(sid, node) for node, sids in zip(down, members, strict=True)
                 for sid in sorted(sids)]
        entries = await self._each(lambda p: [p.hgetall(self._k("sbx", sid))
                                              for sid, _ in owned])
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
        old = Indexed.load(await self.redis.hget(self._k("sbx", sandbox_id), "ix"))
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._k("sbx", sandbox_id))
        pipe.set(self._k("forgotten", sandbox_id), "1", px=FORGOTTEN_MS)
        move(pipe, self.index, old, None)
        await pipe.execute()

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
