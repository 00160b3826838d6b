"""Human tables and ``--json`` output."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(columns: list[str], rows: list[list[str]]) -> None:
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    out.print(t)


def _parse(ts: Any) -> datetime | None:
    if ts is None:
        return None
    if isinstance(ts, (int, float)):
        return datetime.fromtimestamp(ts, UTC)
    try:
        return datetime.fromisoformat(str(ts).replace("Z", "+00:00"))
    except ValueError:
        return None


def ago(ts: Any) -> str:
    t = _parse(ts)
    if t is None:
        return "-"
    return f"{_span((datetime.now(UTC) - t).total_seconds())} ago"


def until(ts: Any) -> str:
    t = _parse(ts)
    if t is None:
        return "-"
    left = (t - datetime.now(UTC)).total_seconds()
    return f"in {_span(left)}" if left > 0 else "due"


def _span(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def size(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def lineage_tree(node: dict, mark: bool = False) -> Tree:
    """A lineage node and what came of it (GET /snapshots/{id}/lineage) as a rich tree;
    ``mark``: this node is the one asked about."""
    tree = Tree(Text(_lineage_label(node), style="bold" if mark else ""))
    for child in node.get("children", []):
        tree.children.append(lineage_tree(child))
    return tree


def _lineage_label(node: dict) -> str:
    kind, ident = node["kind"], node["id"]
    if kind == "template":
        return f"template {ident}"
    if kind == "sandbox":
        resets = node.get("resets") or []
        last = f", reset {len(resets)}x, last to {resets[-1]['snapshotID']} " \
               f"{ago(resets[-1].get('at'))}" if resets else ""
        return f"sandbox {ident} ({node.get('state', '?')}){last}"
    what = "pause" if node.get("snapshotKind") == "pause" else "snapshot"
    name = f" {node['name']}" if node.get("name") else ""
    return f"{what} {ident}{name}, {size(node.get('bytes'))}, {ago(node.get('createdAt'))}"
