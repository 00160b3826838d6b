"""Filtering and cursor pagination over a node's sandbox records.

A page is a slice of the records sorted by (start time, sandbox ID), newest first
unless asked otherwise (E2B's default order); the cursor names the last record
handed out and the order it was handed out in, so sandboxes created or removed
between two pages neither repeat nor shift the next page.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

# Parsed alike by the nodes and the gateway.
from ..sandbox_api import EXTRA_STATES as EXTRA_STATES
from ..sandbox_api import LISTED_STATES
from ..sandbox_api import parse_metadata as parse_metadata
from ..sandbox_api import parse_states as parse_states
from .models import BadRequest, SandboxRecord, SandboxState

MAX_PAGE = 100


def public_state(record: SandboxRecord) -> str | None:
    """The state a client sees, or None for a record it should not see yet (or any more)."""
    if record.state is SandboxState.RUNNING:
        return "running"
    value = str(record.state.value)
    if value in ("paused", "error"):
        return value
    return None  # creating, killed, or a transitional state


@dataclass
class SandboxQuery:
    metadata: dict[str, str] = field(default_factory=dict)
    states: frozenset[str] = frozenset(LISTED_STATES)
    template: str | None = None
    # Microseconds since the epoch, as the API shows start times (``epoch_micros``).
    started_after: int | None = None
    started_before: int | None = None
    # Newest first, as E2B lists unless ``order=asc``.
    descending: bool = True

    def matches(self, record: SandboxRecord) -> bool:
        if public_state(record) not in self.states:
            return False
        if self.template and self.template not in (record.template_id, record.alias):
            return False
        # "at or after" and "at or before", to the microsecond RFC 3339 times carry
        started = epoch_micros(record.started_at)
        if self.started_after is not None and started < self.started_after:
            return False
        if self.started_before is not None and started > self.started_before:
            return False
        return all(record.metadata.get(k) == v for k, v in self.metadata.items())


@dataclass
class Page:
    items: list[SandboxRecord]
    next_token: str | None


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def epoch_micros(when: float | datetime) -> int:
    """A time as the API shows it: whole microseconds, rounded as ``datetime`` rounds
    (comparing ``round(t * 1e6)`` instead missed "at or after" for ~6 % of times)."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when, tz=UTC)
    return (when - _EPOCH) // _MICROSECOND


def _sort_key(record: SandboxRecord) -> tuple[float, str]:
    return (record.started_at, record.sandbox_id)


def _order(descending: bool) -> str:
    return "desc" if descending else "asc"


def encode_token(record: SandboxRecord, descending: bool) -> str:
    raw = json.dumps([record.started_at, record.sandbox_id, _order(descending)],
                     separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, descending: bool) -> tuple[float, str]:
    """The cursor, which must come from a listing in the same order: replayed in the
    other one it would hand out again what the caller has seen (E2B refuses it too)."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        started_at, sandbox_id, order = json.loads(raw)
        cursor = float(started_at), str(sandbox_id)
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest("invalid nextToken") from None
    if order != _order(descending):
        raise BadRequest(f"invalid nextToken: it was issued for order={order}, "
                         f"not order={_order(descending)}")
    return cursor


def select(records: Iterable[SandboxRecord], query: SandboxQuery) -> list[SandboxRecord]:
    """Every record the query matches, in its order."""
    return sorted((r for r in records if query.matches(r)), key=_sort_key,
                  reverse=query.descending)


def page(records: Iterable[SandboxRecord], query: SandboxQuery, limit: int | None = None,
         next_token: str | None = None) -> Page:
    if limit is None:
        limit = MAX_PAGE
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"limit must be between 1 and {MAX_PAGE}")
    chosen = select(records, query)
    if next_token:
        cursor = decode_token(next_token, query.descending)
        if query.descending:
            chosen = [r for r in chosen if _sort_key(r) < cursor]
        else:
            chosen = [r for r in chosen if _sort_key(r) > cursor]
    items = chosen[:limit]
    more = len(chosen) > limit
    return Page(items, encode_token(items[-1], query.descending) if more and items else None)

