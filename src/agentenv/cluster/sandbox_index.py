"""The gateway's listings from Redis: indexes of every sandbox the nodes report, kept
from their heartbeats' changes (and the gateway's own creates, pauses and kills), read
a page at a time. A listing asks no node: a page costs O(limit) Redis reads whatever the
number of nodes or sandboxes.

Keys (under the registry's prefix):

- ``lst:all``: every sandbox a node reported, as a sorted set of one score whose
  members sort by start time, then ID: ``<start in µs, 20 digits>|<sandbox ID>``
  (``ZRANGE ... BYLEX`` reads a page from a cursor: stable while sandboxes come and go);
- ``lst:st:<state>``: the same, per state (a listing by one state reads that one);
- ``lst:md:<hash of a key and its value>``: the same, per metadata pair (the first
  ``MAX_INDEXED_PAIRS`` pairs of a sandbox, each of at most ``MAX_PAIR_CHARS``);
- ``sbx:<id>``'s field ``ix``: the member and the indexes it is in (``Indexed``), so a
  change moves it and a kill drops it without reading the indexes.

Which index a listing reads: a metadata filter's pair with the fewest members, else its
one state's, else ``all``; what the index cannot say (the other pairs, the template,
the states of several) is checked on each candidate, at most ``MAX_SCAN`` of them per
page: a page that runs out of them is shorter, with a token to go on (E2B's clients go
on while there is one).

Sandboxes of a node marked down (``down``, kept by the scheduler's sweeper and the
node's heartbeats) are not read from the indexes: ``lost.py`` lists them, and they
are merged into the page in order.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..sandbox_api import BadRequest

MAX_PAGE = 100
# Candidates a page reads at most (a filter the indexes cannot answer).
MAX_SCAN = 5000
CHUNK = 200
MAX_INDEXED_PAIRS = 16
MAX_PAIR_CHARS = 512
# A listing's filters: at most this many metadata pairs, this long in all.
MAX_FILTER_PAIRS = 16
MAX_FILTER_CHARS = 4096
MAX_TOKEN_CHARS = 512
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_DIGITS = 20


RUN_METADATA = "aenv.run"  # the metadata pair of a run's members


def micros(raw: Any) -> int | None:
    """An RFC 3339 time (a listing's ``startedAt``) in µs since the epoch."""
    if not isinstance(raw, str) or len(raw) > 64:
        return None
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    us = round(when.timestamp() * 1_000_000)
    return us if 0 <= us < 10 ** _DIGITS else None


def rfc3339(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def member(us: int, sandbox_id: str) -> str:
    return f"{us:0{_DIGITS}d}|{sandbox_id}"


def split(m: str) -> tuple[int, str]:
    us, _, sid = m.partition("|")
    return int(us), sid


def pair_hash(key: str, value: str) -> str:
    return hashlib.sha1(json.dumps([key, value]).encode()).hexdigest()[:20]


@dataclass
class Indexed:
    """Where a sandbox is indexed: its member, state and metadata pairs' hashes."""

    member: str
    state: str
    pairs: list[str] = field(default_factory=list)

    def dump(self) -> str:
        return json.dumps([self.member, self.state, self.pairs], separators=(",", ":"))

    @classmethod
    def load(cls, raw: str | None) -> Indexed | None:
        if not raw:
            return None
        try:
            m, state, pairs = json.loads(raw)
            return cls(str(m), str(state), [str(p) for p in pairs])
        except (ValueError, TypeError):
            return None


def indexed(sandbox_id: str, state: str, item: dict[str, Any] | None,
            old: Indexed | None) -> Indexed | None:
    """Where a sandbox goes now: from its listing item when there is one, else where it
    was (a state change the gateway saw); None when nothing says its start time."""
    started = micros(item.get("startedAt")) if item else None
    if started is None:
        return Indexed(old.member, state, old.pairs) if old else None
    meta = item.get("metadata") if item else None
    pairs = []
    if isinstance(meta, dict):
        for k, v in list(meta.items())[:MAX_INDEXED_PAIRS]:
            if isinstance(v, str) and len(k) + len(v) <= MAX_PAIR_CHARS:
                pairs.append(pair_hash(k, v))
    run = item.get("runID") if item else None
    if isinstance(run, str) and 0 < len(run) <= MAX_PAIR_CHARS:
        # A run's member made with the run header has no aenv.run metadata: indexed
        # under that pair all the same, so that a run's end finds all of its members.
        pairs.append(pair_hash(RUN_METADATA, run))
    return Indexed(member(started, sandbox_id), state, sorted(set(pairs)))


class Keys:
    def __init__(self, prefix: str) -> None:
        self.all = prefix + "lst:all"
        self.prefix = prefix

    def state(self, state: str) -> str:
        return f"{self.prefix}lst:st:{state}"

    def pair(self, h: str) -> str:
        return f"{self.prefix}lst:md:{h}"


def move(pipe: Any, keys: Keys, old: Indexed | None, new: Indexed | None) -> None:
    """Queue on ``pipe`` what moves a sandbox's index entries from ``old`` to ``new``
    (either None: added, dropped); nothing when they are the same."""
    if old is not None:
        if new is None or new.member != old.member:
            gone_all, gone_state, gone_pairs = True, True, old.pairs
        else:
            gone_all, gone_state = False, new.state != old.state
            gone_pairs = [p for p in old.pairs if p not in new.pairs]
        if gone_all:
            pipe.zrem(keys.all, old.member)
        if gone_state:
            pipe.zrem(keys.state(old.state), old.member)
        for p in gone_pairs:
            pipe.zrem(keys.pair(p), old.member)
    if new is not None:
        same = old is not None and old.member == new.member
        if not same:
            pipe.zadd(keys.all, {new.member: 0})
        if not same or new.state != old.state:  # type: ignore[union-attr]
            pipe.zadd(keys.state(new.state), {new.member: 0})
        for p in new.pairs:
            if not same or p not in old.pairs:  # type: ignore[union-attr]
                pipe.zadd(keys.pair(p), {new.member: 0})


# -- the query --------------------------------------------------------------------------


@dataclass
class Query:
    states: frozenset[str]
    metadata: dict[str, str]
    template: str | None = None
    after_us: int | None = None  # started at or after
    before_us: int | None = None  # started at or before
    desc: bool = True
    cursor: tuple[int, str] | None = None

    def order_key(self, us: int, sid: str) -> tuple[int, str]:
        """E2B's order: by start time (newest first unless asc), then ID ascending."""
        return (-us, sid) if self.desc else (us, sid)

    def after_cursor(self, us: int, sid: str) -> bool:
        return self.cursor is None or self.order_key(us, sid) > self.order_key(*self.cursor)

    def in_range(self, us: int) -> bool:
        return (self.after_us is None or us >= self.after_us) and \
            (self.before_us is None or us <= self.before_us)

    def matches(self, item: dict[str, Any], state: str) -> bool:
        meta = item.get("metadata") or {}
        return state in self.states and isinstance(meta, dict) \
            and all(meta.get(k) == v for k, v in self.metadata.items()) \
            and (not self.template or self.template in (item.get("templateID"),
                                                        item.get("alias")))


def clamp_limit(raw: str | None) -> int:
    """E2B's ``limit``: an integer, clamped to 1..MAX_PAGE (its default)."""
    if raw is None or raw == "":
        return MAX_PAGE
    if len(raw) > 12 or not re.fullmatch(r"-?\d+", raw):
        raise BadRequest(f"invalid limit {raw[:40]!r}: expected an integer")
    return min(max(int(raw), 1), MAX_PAGE)


def encode_token(us: int, sid: str, desc: bool) -> str:
    """E2B's cursor: base64url of ``<RFC 3339 time>__<id>`` (``__asc`` added for asc)."""
    raw = f"{rfc3339(us)}__{sid}" + ("" if desc else "__asc")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def decode_token(token: str, desc: bool) -> tuple[int, str]:
    if len(token) > MAX_TOKEN_CHARS:
        raise BadRequest("invalid nextToken: too long (pass the x-next-token of the "
                         "previous page as it was)")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError):
        raise BadRequest("invalid nextToken: not a token this API issued (pass the "
                         "x-next-token of the previous page as it was)") from None
    parts = raw.split("__")
    asc = len(parts) == 3 and parts[2] == "asc"
    us = micros(parts[0]) if len(parts) in (2, 3) else None
    if us is None or not _ID.fullmatch(parts[1]) or (len(parts) == 3 and not asc):
        raise BadRequest("invalid nextToken: not a token this API issued (pass the "
                         "x-next-token of the previous page as it was)")
    if asc == desc:
        issued, asked = ("asc", "desc") if asc else ("desc", "asc")
        raise BadRequest(f"invalid nextToken: it was issued for order={issued}, "
                         f"not order={asked}")
    return us, parts[1]


def bounded_metadata(pairs: dict[str, str], raw: str | None) -> dict[str, str]:
    if raw and len(raw) > MAX_FILTER_CHARS:
        raise BadRequest(f"metadata filter longer than {MAX_FILTER_CHARS} characters")
    if len(pairs) > MAX_FILTER_PAIRS:
        raise BadRequest(f"metadata filter of more than {MAX_FILTER_PAIRS} pairs")
    return pairs


# -- reading an index in order ------------------------------------------------------------


async def walk(redis: Any, key: str, q: Query, chunk: int = CHUNK
               ) -> AsyncIterator[list[tuple[int, str]]]:
    """The members of one index in the query's order, after its cursor and within its
    time bounds, a chunk at a time."""
    lo = f"[{member(q.after_us, '')}" if q.after_us is not None else "-"
    hi = f"({q.before_us:0{_DIGITS}d}}}" if q.before_us is not None else "+"
    if not q.desc:  # start time, then ID, both ascending: the index's own order
        start = f"({member(*q.cursor)}" if q.cursor else lo
        while True:
            got = await redis.zrange(key, start, hi, bylex=True, offset=0, num=chunk)
            if not got:
                return
            yield [split(m) for m in got]
            start = f"({got[-1]}"
    # Newest first, IDs ascending among equal start times: the index read backwards
    # by time, each start time's IDs read forwards (``tie``).
    tie = q.cursor  # within this start time, after this ID
    upper = hi
    while True:
        if tie is not None:
            us, sid = tie
            got = await redis.zrange(key, f"({member(us, sid)}", f"({us:0{_DIGITS}d}}}",
                                     bylex=True, offset=0, num=chunk)
            if got:
                yield [split(m) for m in got]
            if len(got) == chunk:
                tie = split(got[-1])
                continue
            bound = f"({member(us, '')}"
            upper = bound if hi == "+" or bound < hi else hi
            tie = None
        got = await redis.zrange(key, upper, lo, bylex=True, desc=True, offset=0, num=chunk)
        if not got:
            return
        rows = [split(m) for m in got]
        if len(got) == chunk:  # the last start time may go on past the chunk: read it whole
            last = rows[-1][0]
            rows = [r for r in rows if r[0] != last]
            if not rows:  # one start time fills the chunk
                tie = (last, "")
                continue
        rows.sort(key=lambda r: (-r[0], r[1]))
        yield rows
        if len(got) == chunk:
            tie = (last, "")
        else:
            return
