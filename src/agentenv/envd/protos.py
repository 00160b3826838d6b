"""The E2B envd protocol modules (generated Connect/protobuf code), relocated.

The ``e2b`` package ships the generated ``process`` and ``filesystem`` modules,
but importing them as ``e2b.envd...`` runs ``e2b/__init__.py`` (the whole SDK).
envd instead imports a small package, ``aenv_envd_protos``, holding copies of
just those generated files; they use relative imports, so they work relocated.
In the runtime bundle that package sits in the bundle's site dir; on a
development host :func:`ensure_importable` builds it from the installed e2b
package into a cache dir (never imported from the repository).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "aenv_envd_protos"
_FILES = {
    "process": ("process_connect.py", "process_pb.py"),
    "filesystem": ("filesystem_connect.py", "filesystem_pb.py"),
}


def e2b_envd_dir() -> Path:
    """Directory of the installed e2b package's ``envd`` sub-package (not imported)."""
    spec = importlib.util.find_spec("e2b")  # top-level: finds without executing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the e2b package (pinned dev dependency) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "envd"


def source_files() -> list[Path]:
    src = e2b_envd_dir()
    return [src / sub / name for sub, names in _FILES.items() for name in names]


def write_package(site_dir: Path) -> Path:
    """Write ``aenv_envd_protos`` (the four generated modules) under ``site_dir``."""
    src = e2b_envd_dir()
    pkg = site_dir / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""E2B envd protocol modules, copied from e2b."""\n')
    for sub, names in _FILES.items():
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
        for name in names:
            shutil.copyfile(src / sub / name, pkg / sub / name)
    return pkg


def _cache_root() -> Path:
    base = os.environ.get("AENV_ENVD_PROTOS_CACHE")
    if base:
        return Path(base)
    return Path(tempfile.gettempdir()) / "aenv-envd-protos"


def ensure_importable() -> None:
    """Make ``aenv_envd_protos`` importable, building it from e2b if needed."""
    if importlib.util.find_spec(PACKAGE) is not None:
        return
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.read_bytes())
    root = _cache_root() / h.hexdigest()[:16]
    if not (root / PACKAGE / "filesystem" / "filesystem_pb.py").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".tmp-"))
        write_package(tmp)
        try:
            tmp.rename(root)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
