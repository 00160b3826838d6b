"""Read-only overlay mounts of a template's layers, one per image, shared by its sandboxes.

Each sandbox's writes go to its runtime's private upper layer; the host mount
has no upper directory at all. Lower directories are passed relative to the
layer store (the mount runs there) so that many layers fit the one-page limit
of mount options.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import ImageError
from .store import MOUNTPOINTS

log = logging.getLogger(__name__)
MAX_OPTIONS = 4000  # mount data is one page


def mounted_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory``, deepest first."""
    prefix = str(directory.resolve()) if directory.exists() else str(directory)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def mount_layers(target: Path, layers_dir: Path, hexes_bottom_up: list[str]) -> None:
    lowers = [*reversed(hexes_bottom_up), MOUNTPOINTS]
    options = "ro,lowerdir=" + ":".join(lowers)
    cwd, links = layers_dir, None
    if len(options) > MAX_OPTIONS:
        # Too many layers for their names: short symlinks to them, resolved by the
        # mount itself and not needed after it.
        links = Path(tempfile.mkdtemp(prefix="links.", dir=layers_dir.parent / "tmp"))
        for i, name in enumerate(lowers):
            os.symlink(layers_dir / name, links / f"{i:x}")
        options = "ro,lowerdir=" + ":".join(f"{i:x}" for i in range(len(lowers)))
        cwd = links
    target.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(target)],
                              cwd=cwd, capture_output=True, text=True)
    finally:
        if links is not None:
            shutil.rmtree(links, ignore_errors=True)
    if proc.returncode != 0:
        raise ImageError(f"overlay mount of {target.name} failed: {proc.stderr.strip()}")


def unmount(target: Path) -> None:
    proc = subprocess.run(["umount", str(target)], capture_output=True, text=True)
    if proc.returncode != 0 and os.path.ismount(target):
        # Busy: something still has a file open. Detach now, freed once closed.
        log.warning("rootfs %s busy (%s); detaching it", target, proc.stderr.strip())
        subprocess.run(["umount", "-l", str(target)], capture_output=True)
    try:
        target.rmdir()
    except OSError:
        pass
