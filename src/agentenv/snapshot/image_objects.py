"""What lazily loaded images leave in the shared repository, and when it goes.

Per layer (``<hex>``: the sha256 of its compressed blob):
- ``image-layers/<hex>.json.zst``: its index (``layer_index``); a converted layer's
  index names repository chunks, a plain gzip layer's names ranges of its registry blob;
- ``image-prefetch/<hex>.json``: the files its first run read (``images.prefetch``);
- ``image-used/<hex>``: when a node last used the layer (its clock, JSON). Nodes write
  it when they find or make the index and every ``REFRESH_S`` while the layer is served,
  always under a commit lease (``lease.begin_commit``), and read the index only after.

The rule the collector applies, under its lock with no commit lease live (so no node is
between writing its stamp and reading the index): a layer's objects are kept while

1. a template published in the repository (``templates/``) names the layer, or
2. its stamp is younger than the retention window (days: a task's image comes back
   within it, and one that does not costs one more index build), or
3. it has no stamp yet (objects written before stamps existed): the collector stamps it
   now, which starts its clock rather than deleting it at once.

Past a size budget (bytes of indexes), the least recently used
layers not kept by rule 1 go first, retention or not, but never one used in the last
``MIN_AGE_S`` (a node serving it refreshes its stamp every ``REFRESH_S``, well inside
that). A layer collected is used again by re-indexing it: nothing breaks, it costs one
read of the layer. Chunks that only a collected converted index named are then free
and swept with the snapshots' garbage.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from .errors import ObjectMissing
from .layer_index import PREFIX as INDEX_PREFIX
from .repository import Repository

log = logging.getLogger("agentenv.snapshot")

PREFETCH_PREFIX = "image-prefetch/"
USED_PREFIX = "image-used/"
TEMPLATES_PREFIX = "templates/"  # shared_templates.TEMPLATES
RETENTION_S = 14 * 86400.0
REFRESH_S = 3600.0
MIN_AGE_S = 3 * REFRESH_S
MAX_STAMP_BYTES = 4096
MAX_TEMPLATE_BYTES = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LAYER_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


def used_key(layer_hex: str) -> str:
    return f"{USED_PREFIX}{layer_hex}"


def prefetch_key(layer_hex: str) -> str:
    return f"{PREFETCH_PREFIX}{layer_hex}.json"


def stamp(repo: Repository, layer_hex: str, at: float, node: str = "") -> None:
    """Record a use of the layer (callers hold a commit lease; see the module doc)."""
    repo.put_object(used_key(layer_hex), json.dumps({"used": at, "node": node}).encode())


@dataclass
class ImageLayer:
    """One layer's objects in the repository."""

    index: str | None = None
    prefetch: str | None = None
    used: str | None = None
    used_at: float | None = None
    # Bytes of its index (its chunks' are counted by the snapshot sweep).
    index_bytes: int = 0
    chunks: set[str] = field(default_factory=set)

    def keys(self) -> list[str]:
        # The stamp last: a crash midway leaves it, and the next run finishes the job.
        return [k for k in (self.index, self.prefetch, self.used) if k]


def layers_in(repo: Repository) -> dict[str, ImageLayer]:
    """Every layer with an index, a prefetch list or a stamp (no object read yet)."""
    out: dict[str, ImageLayer] = {}
    for prefix, suffix, attr in ((INDEX_PREFIX, ".json.zst", "index"),
                                 (PREFETCH_PREFIX, ".json", "prefetch"),
                                 (USED_PREFIX, "", "used")):
        for key in repo.list_objects(prefix):
            h = key.removeprefix(prefix)
            h = h[:-len(suffix)] if suffix and h.endswith(suffix) else h
            if _HEX.match(h):  # anything else here is not ours to remove
                setattr(out.setdefault(h, ImageLayer()), attr, key)
    return out


def read_stamp(repo: Repository, key: str) -> float | None:
    """A stamp's time; None when it vanished. A stamp that does not parse counts as
    written now (it is rewritten by the caller): a damaged stamp never frees a layer."""
    try:
        body = repo.get_object(key)
    except ObjectMissing:
        return None
    try:
        value = float(json.loads(body[:MAX_STAMP_BYTES])["used"])
    except (ValueError, KeyError, TypeError):
        return float("nan")
    return value


def template_layers(repo: Repository) -> set[str] | None:
    """Layers the repository's published templates name; None when a template cannot
    be read (then no image object is collected this run: it may name any layer)."""
    out: set[str] = set()
    for key in repo.list_objects(TEMPLATES_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            doc = json.loads(repo.get_object(key)[:MAX_TEMPLATE_BYTES])
        except ObjectMissing:
            continue
        except ValueError:
            log.warning("snapshot gc: template %s does not parse; no image index is "
                        "collected this run", key)
            return None
        image = doc.get("image") if isinstance(doc, dict) else None
        for layer in (image or {}).get("layers") or [] if isinstance(image, dict) else []:
            digest = layer.get("digest") if isinstance(layer, dict) else None
            m = _LAYER_DIGEST.match(digest) if isinstance(digest, str) else None
            if m:
                out.add(m.group(1))
    return out


def doomed_layers(layers: dict[str, ImageLayer], named: set[str], now: float, *,
                  retention_s: float, budget_bytes: int) -> list[str]:
    """The layers whose objects go (the rule in the module doc); ``used_at`` filled in,
    NaN for a stamp to write now."""
    doomed: list[str] = []
    kept: list[tuple[float, str]] = []
    for h, layer in layers.items():
        if h in named:
            continue
        used = layer.used_at
        if used is None or used != used:  # no stamp, or a damaged one: its clock starts
            continue
        if now - used > retention_s:
            doomed.append(h)
        else:
            kept.append((used, h))
    if budget_bytes > 0:
        total = sum(x.index_bytes for h, x in layers.items() if h not in doomed)
        for used, h in sorted(kept):
            if total <= budget_bytes or now - used < MIN_AGE_S:
                break
            doomed.append(h)
            total -= layers[h].index_bytes
    return doomed
