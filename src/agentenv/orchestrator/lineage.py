"""Snapshot lineage: which template, snapshot or sandbox each snapshot and sandbox
came from, as a tree (template -> sandbox -> snapshot -> sandboxes made from it ->
their forks -> their snapshots ...).

Edges come from what is recorded anyway: a snapshot's metadata names the sandbox it
was taken of (``source_sandbox_id``) and what that sandbox came from (``origin``), so
the tree outlives the sandboxes; a live sandbox's record has its own ``origin``. A
sandbox that is gone appears once, as ``gone``, between its origin and its snapshots.
A reset is not an edge: it is listed in the sandbox's details (``resets``), since
the snapshot reset to is often the sandbox's own child. The tree never cycles: an
edge that would close one (a record written when resets were edges, a hand-edited
repository) is skipped for the next of its chain.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..snapshot import Manifest
from .models import SandboxRecord

# The captures a user made or can resume from; a template's boot image is internal.
SHOWN_KINDS = ("snapshot", "pause")


@dataclass
class Node:
    kind: str  # template | snapshot | sandbox
    id: str
    parent: str = ""  # the key of the node it came from, "" for a root
    detail: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)
    ghost: bool = False  # named by another's origin, not seen (yet) itself

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.id}"


def fork_origin(source: SandboxRecord) -> str:
    """A fork child's origin: its source, then the source's own origin, up to the
    nearest template or snapshot (those outlive sandboxes; a chain of forks of
    forks keeps its first MAX_CHAIN sandboxes and that durable end)."""
    chain = [f"sandbox:{source.sandbox_id}", *origin_chain(source.origin,
                                                           source.template_id)]
    if len(chain) > MAX_CHAIN:
        chain = [*chain[:MAX_CHAIN - 1], chain[-1]]
    return " ".join(chain)


def origin_chain(origin: str, template_id: str) -> list[str]:
    """An origin as the keys it names, nearest first ("" means the template)."""
    return origin.split() if origin else [f"template:{template_id}"]


MAX_CHAIN = 32


class Lineage:
    def __init__(self, manifests: Iterable[Manifest], records: Iterable[SandboxRecord]):
        self.nodes: dict[str, Node] = {}
        for r in records:
            node = self._add(Node("sandbox", r.sandbox_id, "",
                                  {"state": str(r.state), "templateID": r.template_id,
                                   "createdAt": _iso(r.started_at),
                                   "resets": [{"snapshotID": str(e.get("snapshotID", "")),
                                               "at": _iso(float(e.get("at") or 0)),
                                               "mode": str(e.get("mode") or "memory")}
                                              for e in r.resets]}))
            self._link(node, origin_chain(r.origin, r.template_id))
        for m in sorted(manifests, key=lambda m: m.created_at):
            meta = m.metadata
            if meta.get("kind") not in SHOWN_KINDS:
                continue
            template = str(meta.get("template_id") or "")
            source = str(meta.get("source_sandbox_id") or "")
            snap = self._add(Node("snapshot", m.snapshot_id, "", {
                "snapshotKind": meta.get("kind"), "name": m.alias, "templateID": template,
                "createdAt": _iso(m.created_at), "bytes": m.total_bytes}))
            chain = origin_chain(str(meta.get("origin") or ""), template)
            self._link(snap, [f"sandbox:{source}", *chain] if source else chain)
        for node in self.nodes.values():
            if node.parent:
                self.nodes[node.parent].children.append(node.key)

    def _link(self, node: Node, chain: list[str]) -> None:
        """``node`` came from ``chain[0]``, which came from ``chain[1]``, ...: nodes not
        seen (sandboxes since deleted, templates) are added on the way."""
        for key in chain:
            if node.parent or key == node.key:
                return  # known already, from its own record or an earlier chain
            if self._descends(key, node.key):
                continue  # that edge would close a cycle
            node.parent = key
            kind, _, ident = key.partition(":")
            node = self._add(Node(kind, ident, "", {} if kind == "template" else
                                  {"state": "gone"}, ghost=True))

    def _descends(self, key: str, ancestor: str) -> bool:
        """``key`` is ``ancestor`` or below it, as linked so far."""
        seen: set[str] = set()
        while key and key not in seen:
            if key == ancestor:
                return True
            seen.add(key)
            known = self.nodes.get(key)
            key = known.parent if known else ""
        return False

    def _add(self, node: Node) -> Node:
        known = self.nodes.setdefault(node.key, node)
        if known.ghost and not node.ghost:  # seen at last: its own details
            known.detail, known.ghost = node.detail, False
        return known

    def ancestors(self, key: str) -> list[dict[str, Any]]:
        """From the root down to ``key``'s parent (a cycle, which the data cannot
        make but a hand-edited repository could, stops the walk)."""
        out: list[dict[str, Any]] = []
        seen = {key}
        parent = self.nodes[key].parent
        while parent and parent not in seen:
            seen.add(parent)
            out.append(self._flat(self.nodes[parent]))
            parent = self.nodes[parent].parent
        return out[::-1]

    def tree(self, key: str, depth: int = 64) -> dict[str, Any]:
        node = self.nodes[key]
        out = self._flat(node)
        out["children"] = [self.tree(c, depth - 1) for c in node.children] if depth else []
        return out

    def roots(self) -> list[str]:
        return [k for k, n in self.nodes.items() if not n.parent]

    @staticmethod
    def _flat(node: Node) -> dict[str, Any]:
        return {"kind": node.kind, "id": node.id, **node.detail}


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")
