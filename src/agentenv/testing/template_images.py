"""Template boot images shared by the suite's nodes, as a cluster's nodes share them.

Each test node has a home, and so a snapshot repository, of its own. Its first sandbox
of a template therefore boots cold and captures the template's boot image: ~3 CPU-s
for ``base``, ~25 for ``code-interpreter``, in every node home of a run, while nodes
that share a repository build each image once. Here a seed repository on the machine
stands in for that sharing, for the templates every node shares (those under
``SHARED_HOME/images/templates``): a node's images of them are copied into the seed
when it stops, and the newest of each from the seed into a node's own repository
before it starts (hard links: chunks are named by their content and never change).

An image's alias names everything it depends on (template build, envd bundle, runtime:
``orchestrator.boot_images``), so a node only ever restores an image made for what it
runs. Copies go through the repository interface: chunks, then the manifest, then the
alias, so a copy cut short is never used. Only a posix_fs repository is seeded; a test
of the cold path opts out (``node.seed_images = False``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

from ..snapshot.errors import SnapshotError
from ..snapshot.manifest import Manifest
from ..snapshot.posix import PosixRepository

log = logging.getLogger(__name__)
IMAGE_PREFIX = "tpl."
KEEP_PER_TEMPLATE = 2  # images of one shared template kept in the seed (newest first)


def _shared_templates(shared_home: Path) -> set[str]:
    root = shared_home / "images" / "templates"
    return {d.name for d in root.iterdir() if d.is_dir()} if root.is_dir() else set()


def _template_of(alias: str) -> str:
    """``tpl.<templateID>.<hash>`` -> templateID."""
    return alias.removeprefix(IMAGE_PREFIX).rpartition(".")[0]


def _aliases(repo: PosixRepository) -> list[str]:
    return [k.removeprefix("aliases/") for k in repo.list_objects("aliases/")
            if k.startswith("aliases/" + IMAGE_PREFIX)]


@contextlib.contextmanager
def _locked(seed: Path, exclusive: bool) -> Iterator[None]:
    """Readers share the seed; a writer (copy in, then prune) has it alone, so a prune
    never drops the chunks of an image being copied in."""
    seed.mkdir(parents=True, exist_ok=True)
    with open(seed / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def _copy(src: PosixRepository, dst: PosixRepository, alias: str) -> bool:
    """Copy one image (its chunks, manifest and alias); False if ``src`` lost it meanwhile."""
    try:
        snapshot_id = src.get_object(f"aliases/{alias}").decode().strip()
        raw = src.get_object(f"manifests/{snapshot_id}.json")
        for digest in Manifest.from_json(raw).digests():
            if not dst.has_chunk(digest) and not dst.link_chunk(digest, src):
                dst.put_chunk(digest, src.get_chunk(digest))
        dst.put_object(f"manifests/{snapshot_id}.json", raw)
        dst.put_object(f"aliases/{alias}", snapshot_id.encode())
    except SnapshotError as exc:
        log.info("template image %s not copied: %s", alias, exc)
        return False
    return True


def import_images(seed: Path, repository: Path, shared_home: Path) -> list[str]:
    """Copy the seed's images of shared templates that ``repository`` lacks; their aliases."""
    if not seed.is_dir():
        return []
    shared = _shared_templates(shared_home)
    with _locked(seed, exclusive=False):
        src = PosixRepository(seed, fsync=False)
        dst = PosixRepository(repository, fsync=False)  # a test node's: nothing to keep
        have = set(_aliases(dst))
        return [a for a in _newest(src, shared)
                if a not in have and _copy(src, dst, a)]


def _newest(seed: PosixRepository, templates: set[str]) -> list[str]:
    """The seed's newest image of each of ``templates``: the one made for the code that
    runs now, unless another tree's run exported since."""
    return [found[0][0] for template, found in _images(seed).items() if template in templates]


def _images(seed: PosixRepository) -> dict[str, list[tuple[str, Manifest]]]:
    """The seed's images (alias, manifest) by template, newest first; one it lost
    meanwhile is left out."""
    images: dict[str, list[tuple[str, Manifest]]] = {}
    for alias in _aliases(seed):
        with contextlib.suppress(SnapshotError):
            snapshot_id = seed.get_object(f"aliases/{alias}").decode().strip()
            manifest = Manifest.from_json(seed.get_object(f"manifests/{snapshot_id}.json"))
            images.setdefault(_template_of(alias), []).append((alias, manifest))
    for found in images.values():
        found.sort(key=lambda image: image[1].created_at, reverse=True)
    return images


def export_images(repository: Path, seed: Path, shared_home: Path) -> list[str]:
    """Copy ``repository``'s images of shared templates that the seed lacks, then drop
    the seed's older images of those templates; the aliases copied."""
    if not (repository / "aliases").is_dir():
        return []
    shared = _shared_templates(shared_home)
    src = PosixRepository(repository, fsync=False)
    wanted = [a for a in _aliases(src) if _template_of(a) in shared]
    if not wanted:
        return []
    with _locked(seed, exclusive=True):
        dst = PosixRepository(seed, fsync=False)
        have = set(_aliases(dst))
        copied = [a for a in wanted if a not in have and _copy(src, dst, a)]
        if copied:
            _prune(dst, {_template_of(a) for a in copied})
    return copied


def _prune(seed: PosixRepository, templates: set[str]) -> None:
    """Keep the newest KEEP_PER_TEMPLATE images of each of ``templates``, and the chunks
    the kept manifests name. Best effort: another run may be copying meanwhile (its
    reader skips an image that lost a chunk)."""
    with contextlib.suppress(SnapshotError):
        kept: set[str] = set()
        for template, found in _images(seed).items():
            keep = KEEP_PER_TEMPLATE if template in templates else len(found)
            for alias, manifest in found[keep:]:
                seed.delete_object(f"aliases/{alias}")
                seed.delete_object(f"manifests/{manifest.snapshot_id}.json")
            for _, manifest in found[:keep]:
                kept |= manifest.digests()
        seed.delete_chunks([d for d, _ in seed.list_chunks() if d not in kept])
