"""A node's heartbeat written into the registry (``node_registry``'s keys).

A beat is claimed (``registry_scripts.CLAIM``: same session and base for a diff, not
older than what is stored for a full one), the records that differ from what it says
are found in one command (``DIFFERING``), and every write it makes runs as one script
fenced on its claim (``APPLY``): two beats of one node never interleave, and a beat a
later one has claimed writes nothing. What a node sends is ``beats.py``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from . import registry_scripts as scripts
from .beats import MAX_ITEM_BYTES, Beat
from .common import ClusterError, NodeStatus, SandboxEntry
from .redis_conn import pipelined
from .sandbox_index import Indexed, Keys, indexed, move

# The states a node's load counts (``active_count``): a sandbox freed through the
# gateway stays freed room while a heartbeat still reports it in one of them.
COUNTED_STATES = frozenset({"creating", "running"})



# A node's heartbeat is whole this often (the others are diffs): every record of its
# sandboxes is checked then (an owner moved while the node was up, a record lost).
FULL_CHECK_EVERY = 20



def record_mapping(node_id: str, state: str, snapshot_id: str, committed: bool,
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
        mapping = record_mapping(node_id, self.state, self.snapshot_id, self.committed,
                         self.raw_item)
        mapping["fp"] = self.fp
        return mapping


class Commands:
    """Redis commands queued as a pipeline's methods queue them (the few a heartbeat's
    writes use), to run in one script (``registry_scripts._RUN``). Long ones are cut
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

    def set(self, key: str, value: str, px: int) -> None:
        self.list.append(["SET", key, value, "PX", px])

    def delete(self, *keys: str) -> None:
        self._cut(["DEL"], list(keys))

    @contextlib.contextmanager
    def guard(self, key: str, **read: str) -> Iterator[None]:
        """The commands queued in the block run only if the hash ``key`` still holds
        what was read (``read``: field -> value, '' for none) when they run."""
        at = len(self.list)
        self.list.append([])
        yield
        checks = [x for field, value in read.items() for x in (field, value)]
        self.list[at] = ["GUARD", key, len(self.list) - at - 1, *checks]

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


class HeartbeatWriter:
    """Writes nodes' heartbeats into the registry under ``prefix``."""

    def __init__(self, redis: Any, prefix: str, index: Keys) -> None:
        self.redis, self.prefix, self.index = redis, prefix, index
        self._claim = redis.register_script(scripts.CLAIM)
        self._differing = redis.register_script(scripts.DIFFERING)
        self._apply = redis.register_script(scripts.APPLY)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def apply(self, status: NodeStatus, ttl_ms: int, beat: Beat | None = None
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
        differ = [(sid, (owner, key, ix, state)) for sid, owner, key, ix, state in rows]
        # The node's list (node-fp:<n>) gains what it did not have, and what is written.
        listing = set(reported) - set(previous[0]) if beat.full else set(reported)
        listing.update(sid for sid, _ in differ)
        others = sorted({owner for _, (owner, *_) in differ if owner and owner != nid})
        alive = await pipelined(self.redis,
                                lambda p: [p.exists(self._k("alive", o)) for o in others])
        up = {o for o, a in zip(others, alive, strict=True) if a}
        gone_found = await pipelined(
            self.redis, lambda p: [p.hmget(self._k("sbx", sid), "node", "key", "ix", "state")
                                   for sid in gone])
        # Freed through the gateway, and this heartbeat no longer counts them: its load
        # has their room now. A diff that does not mention one leaves it as the beat it
        # is against had it: still counted if that one listed it.
        if freed and not beat.full:
            unmentioned = [sid for sid in freed if sid not in reported and sid not in gone]
            listed = await pipelined(
                self.redis, lambda p: [p.hexists(self._k("node-fp", nid), sid)
                                       for sid in unmentioned])
            still = {sid for sid, was in zip(unmentioned, listed, strict=True) if was}
        else:
            still = set()
        settled = [sid for sid in freed if sid not in still and (
            sid not in reported or reported[sid].state not in COUNTED_STATES)]

        disown: list[str] = []

        def writes(pipe: Commands) -> None:
            # Each sandbox's writes are guarded on its record as read above: one the
            # gateway changed since (a create's answer, a pause) is newer than this beat,
            # and kept (the node's next beats say what it became).
            for sid, (owner, key, ix, state) in differ:
                entry = reported[sid]
                # A sandbox another live node has taken over (from its last pause, this
                # node being lost meanwhile) stays with that node: this one drops its copy.
                if owner and owner != nid and owner in up:
                    if entry.state in ("paused", "running"):
                        disown.append(sid)
                    continue
                if entry.state == "creating" and state not in ("", "creating"):
                    # A beat taken while the create was under way, applied after the
                    # gateway recorded the create's answer: that record is newer (no
                    # sandbox goes back to creating), and the listings keep showing it.
                    continue
                old = Indexed.load(ix)
                mapping = entry.mapping(nid)
                new = indexed(sid, entry.state, entry.item, old)
                with pipe.guard(self._k("sbx", sid), node=owner, state=state, ix=ix):
                    move(pipe, self.index, old, new)
                    if new is not None:
                        mapping["ix"] = new.dump()
                    pipe.hset(self._k("sbx", sid), mapping=mapping)
                    if key and entry.state == "running":
                        pipe.zadd(self._k("key-run", key), {sid: 0})
                    elif key:  # paused (or on its way): it holds none of its key's quota
                        pipe.zrem(self._k("key-run", key), sid)
            for sid, (owner, key, ix, state) in zip(gone, gone_found, strict=True):
                if owner == nid:
                    with pipe.guard(self._k("sbx", sid), node=owner, state=state or "",
                                    ix=ix or ""):
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

        skipped = 0
        if differ or gone or reported or settled:
            written = await self._fenced(nid, token, writes)
            if written is None:  # a later beat claimed the node
                return Applied([], not was_alive, True, True)
            skipped = written
        # A record the gateway changed under this beat was left as it wrote it: the next
        # beat is whole, so that every record is checked against the node again soon.
        return Applied(disown, not was_alive, skipped > 0 or diffs >= FULL_CHECK_EVERY - 1)

    async def _fenced(self, node_id: str, token: str, queue: Callable[[Commands], None]
                      ) -> int | None:
        """Run what ``queue`` puts on a ``Commands`` at once if the heartbeat that claimed
        the node with ``token`` is still its last claim: how many of its guards failed;
        None (nothing written) once a later beat of the node claimed it: two beats'
        writes never interleave."""
        commands = Commands()
        queue(commands)
        claimed, failed = await self._apply(keys=[self._k("hb", node_id)],
                                            args=[token, json.dumps(commands.list)])
        return int(failed) if int(claimed) else None
