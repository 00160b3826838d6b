"""A node's heartbeat on the wire: built by the node (``Beats``), read by the scheduler
(``read_beat``, which bounds every field a node sends).

A heartbeat carries the node's status (capacity, load, caches...) whole, and its
sandboxes either whole (``full``) or as a diff: the entries changed since the beat the
registry last acknowledged (``base``), and the IDs gone since (``removed``). The first
beat of a node process (``session``, ordered by its start time) is full, and so is any
beat after the registry answers ``{"full": true}`` (it lost track: a beat that failed,
a node that was down, a periodic check). A node that sends no ``session`` (an older
one) sends full beats only, and they are applied as such.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .common import ClusterError, Failover, NodeStatus, SandboxEntry

# Bounds of what a node sends (a node's API key is one secret of many machines: a
# heartbeat is hostile until bounded). The body as a whole: a 413 past
# MAX_HEARTBEAT_BYTES (the scheduler's route), and past MAX_ITEM_BYTES an item (the
# registry, where it is serialized).
MAX_HEARTBEAT_BYTES = 64 << 20
MAX_ITEM_BYTES = 640 << 10  # one sandbox's listing item, as JSON
MAX_SANDBOXES = 100_000  # entries (and removed IDs) in one beat
MAX_NAMES = 100_000  # templates, snapshots
MAX_NAME_CHARS = 256  # a template, snapshot, runtime, state
MAX_URL_CHARS = 2048
MAX_COUNT = 1 << 31  # capacity, load, memory
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SESSION = re.compile(r"[0-9]{20}-[0-9a-f]{1,32}")


@dataclass
class Beat:
    """What a heartbeat says of itself: its node process (``session``), its number
    (``seq``), and for a diff the beat it is against (``base``) and the IDs gone since."""

    session: str = ""
    seq: int = 0
    base: int | None = None  # None: a full beat
    removed: list[str] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.base is None


def new_session() -> str:
    """A node process's session: its start time first, so that a later one sorts after."""
    return f"{time.time_ns():020d}-{secrets.token_hex(8)}"


class Beats:
    """The node's side: each beat's body, a diff against the last beat acknowledged."""

    def __init__(self) -> None:
        self.session = new_session()
        self._seq = 0
        # The last beat the registry applied: its number and its sandboxes.
        self._acked: tuple[int, dict[str, SandboxEntry]] | None = None

    def body(self, status: NodeStatus) -> tuple[dict[str, Any], Sent]:
        """The next beat's JSON body, and what to hand ``answered`` once it is answered."""
        self._seq += 1
        now = {s.sandbox_id: s for s in status.sandboxes}
        body = status.to_dict(sandboxes=False)
        body["session"], body["seq"] = self.session, self._seq
        if self._acked is None:
            body["full"] = True
            body["sandboxes"] = [s.to_dict() for s in now.values()]
        else:
            base, last = self._acked
            body["full"], body["base"] = False, base
            body["sandboxes"] = [s.to_dict() for sid, s in now.items() if last.get(sid) != s]
            body["removed"] = [sid for sid in last if sid not in now]
        return body, Sent(self._seq, now)

    def answered(self, sent: Sent, answer: dict[str, Any]) -> None:
        """The registry answered ``sent``: applied (the next diff is against it) or
        not (``full``: the next beat is whole). A beat with no answer changes nothing:
        the next is against the last applied one, which the registry then refuses
        if the unanswered one was applied after all (it asks for a full beat)."""
        if answer.get("full"):
            self._acked = None
            return
        # A disowned sandbox the node still lists is told of again (and disowned again).
        for sid in answer.get("disown") or []:
            sent.sandboxes.pop(sid, None)
        self._acked = (sent.seq, sent.sandboxes)


@dataclass
class Sent:
    seq: int
    sandboxes: dict[str, SandboxEntry]


async def send_beat(http: httpx.AsyncClient, schedulers: Failover, beats: Beats,
                    status: NodeStatus) -> dict[str, Any]:
    """One heartbeat of ``status`` to the first scheduler that answers; its answer (the
    sandboxes to disown are the caller's to drop). A beat the registry refused (it
    lost track of the node's beats) is followed by a full one at once."""
    body, sent = beats.body(status)
    answer = await _post(http, schedulers, body)
    beats.answered(sent, answer)
    if answer.get("applied") is False:
        body, sent = beats.body(status)
        answer = await _post(http, schedulers, body)
        beats.answered(sent, answer)
    return answer


async def _post(http: httpx.AsyncClient, schedulers: Failover, body: dict[str, Any]
                ) -> dict[str, Any]:
    order = schedulers.order()
    for url in order:  # a scheduler down: the next one, this beat
        try:
            r = await http.post(url + "/nodes/heartbeat", json=body)
            r.raise_for_status()
        except httpx.HTTPError:
            if url == order[-1]:
                raise
            continue
        schedulers.answered(url)
        return dict(r.json())
    raise AssertionError("Failover has at least one URL")


def _text(raw: dict[str, Any], name: str, limit: int, default: str | None = None) -> str:
    value = raw.get(name, default)
    if not isinstance(value, str) or len(value) > limit:
        raise ClusterError(400, f"invalid heartbeat: {name} must be a string of at most "
                                f"{limit} characters")
    return value


def _count(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise ClusterError(400, f"invalid heartbeat: {name} must be an integer in "
                                f"[0, {MAX_COUNT})")
    return value


def _names(raw: dict[str, Any], name: str) -> list[str]:
    value = raw.get(name) or []
    if not isinstance(value, list) or len(value) > MAX_NAMES or not all(
            isinstance(v, str) and len(v) <= MAX_NAME_CHARS for v in value):
        raise ClusterError(400, f"invalid heartbeat: {name} must be at most {MAX_NAMES} "
                                f"strings of at most {MAX_NAME_CHARS} characters")
    return value


def _ids(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_SANDBOXES:
        raise ClusterError(400, f"invalid heartbeat: {name} must be a list of at most "
                                f"{MAX_SANDBOXES}")
    for sid in value:
        if not isinstance(sid, str) or not SANDBOX_ID.fullmatch(sid):
            raise ClusterError(400, f"invalid heartbeat: {name} holds an invalid sandbox "
                                    f"ID {str(sid)[:80]!r}")
    return value


def _entry(raw: Any) -> SandboxEntry:
    if not isinstance(raw, dict):
        raise ClusterError(400, "invalid heartbeat: a sandbox entry must be an object")
    sid = _ids([raw.get("sandbox_id")], "sandboxes")[0]
    item = raw.get("item") or {}
    if not isinstance(item, dict):
        raise ClusterError(400, f"invalid heartbeat: sandbox {sid}'s item must be an object")
    committed = raw.get("committed", False)
    if not isinstance(committed, bool):
        raise ClusterError(400, f"invalid heartbeat: sandbox {sid}'s committed must be a "
                                f"boolean")
    return SandboxEntry(sandbox_id=sid, state=_text(raw, "state", MAX_NAME_CHARS),
                        snapshot_id=_text(raw, "snapshot_id", MAX_NAME_CHARS, ""),
                        committed=committed, item=item)


def read_beat(raw: Any) -> tuple[NodeStatus, Beat]:
    """A heartbeat's body as the scheduler takes it: every field checked and bounded
    (a ClusterError 400 says which is not); the items' sizes are checked where they
    are serialized (``node_registry``, MAX_ITEM_BYTES)."""
    if not isinstance(raw, dict):
        raise ClusterError(400, "invalid heartbeat: the body must be a JSON object")
    node_id = _text(raw, "node_id", 128)
    if not NODE_ID.fullmatch(node_id):
        raise ClusterError(400, "invalid heartbeat: node_id must be 1-128 characters of "
                                "[A-Za-z0-9_.:-]")
    entries = raw.get("sandboxes") or []
    if not isinstance(entries, list) or len(entries) > MAX_SANDBOXES:
        raise ClusterError(400, f"invalid heartbeat: sandboxes must be a list of at most "
                                f"{MAX_SANDBOXES}")
    status = NodeStatus(
        node_id=node_id, url=_text(raw, "url", MAX_URL_CHARS),
        capacity=_count(raw, "capacity"), load=_count(raw, "load"),
        free_memory_mb=_count(raw, "free_memory_mb"),
        runtime_kind=_text(raw, "runtime_kind", MAX_NAME_CHARS),
        runtime_version=_text(raw, "runtime_version", MAX_NAME_CHARS),
        health=_text(raw, "health", MAX_NAME_CHARS, "ok"),
        templates=_names(raw, "templates"), snapshots=_names(raw, "snapshots"),
        sandboxes=[_entry(e) for e in entries])
    session = raw.get("session")
    if session is None:  # an older node: full beats only
        return status, Beat()
    if not isinstance(session, str) or not SESSION.fullmatch(session):
        raise ClusterError(400, "invalid heartbeat: session must be <20 digits>-<hex>")
    seq = raw.get("seq")
    # Below 2**53: exact as a Lua number (the claim compares them).
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 1 << 53:
        raise ClusterError(400, "invalid heartbeat: seq must be a positive integer")
    if raw.get("full", True) is True:
        return status, Beat(session, seq)
    base = raw.get("base")
    if isinstance(base, bool) or not isinstance(base, int) or not 0 < base < seq:
        raise ClusterError(400, "invalid heartbeat: a diff's base must be a positive "
                                "integer below its seq")
    return status, Beat(session, seq, base, _ids(raw.get("removed") or [], "removed"))
