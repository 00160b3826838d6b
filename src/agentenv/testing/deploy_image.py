"""The deployment's image, made here with no registry: an mmdebstrap base and this
checkout, imported as one image (one ``docker import`` of both tars back to back).

The base (scripts/build-deploy-base.sh, a tarball) holds Debian's Python 3.11, runsc,
iproute2, iptables, redis and haproxy. The layer holds ``src/agentenv`` and the
installed files of agentenv's runtime dependencies (the closure of its requirements,
read from the running interpreter's installed distributions: the same versions the
suite tests) with their bytecode, on ``PYTHONPATH``, and an ``aenv`` command.
"""

from __future__ import annotations

import importlib.metadata as md
import io
import posixpath
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.requirements import Requirement

from .docker_engine import DockerEngine

APP = "/opt/agentenv"
LAUNCHER = b"#!/usr/bin/python3\nfrom agentenv.cli.main import app\napp()\n"


def runtime_distributions(root: str = "agentenv") -> list[md.Distribution]:
    """The installed distributions ``root`` needs at run time, ``root`` not included."""
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = seen[key] = md.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    del seen[root]
    return list(seen.values())


def app_layer(source: Path) -> bytes:
    """A tar of the code (``source``: the ``agentenv`` package dir) and its dependencies,
    with their bytecode as compiled here (same 3.11 magic; checked against the sources'
    sizes and mtimes, which the tar keeps), so no container compiles them again."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(source, f"{APP[1:]}/src/agentenv",
                filter=lambda t: None if "__pycache__" in t.name else t)
        for dist in runtime_distributions():
            for f in dist.files or []:
                if ".." in f.parts or "__pycache__" in f.parts:
                    continue  # scripts outside site-packages; bytecode is added below
                path = Path(str(dist.locate_file(f)))
                if not path.is_file():
                    continue
                dest = posixpath.normpath(f"{APP[1:]}/site-packages/{f.parent.as_posix()}")
                tar.add(path, f"{dest}/{path.name}")
                pyc = Path("__pycache__") / f"{path.stem}.{sys.implementation.cache_tag}.pyc"
                if path.suffix == ".py" and (path.parent / pyc).is_file():
                    tar.add(path.parent / pyc, f"{dest}/{pyc}")
        info = tarfile.TarInfo("usr/local/bin/aenv")
        info.size, info.mode = len(LAUNCHER), 0o755
        tar.addfile(info, io.BytesIO(LAUNCHER))
    return buf.getvalue()


def _members_end(base_tar: Path) -> int:
    """Where ``base_tar``'s end-of-archive blocks start: another tar appended there
    makes one archive (docker import stops at the first end marker)."""
    with tarfile.open(base_tar) as tar:
        while tar.next() is not None:
            pass
        return tar.offset


def build(engine: DockerEngine, base_tar: Path, source: Path, tag: str) -> None:
    """``tag``: one ``docker import`` of the base's members followed by ``app_layer``."""
    layer = app_layer(source)
    end = _members_end(base_tar)
    proc = subprocess.Popen(
        ["docker", "import",
         "--change", f"ENV PYTHONPATH={APP}/src:{APP}/site-packages",
         "--change", "ENV AENV_HOME=/var/lib/aenv",
         "--change", 'CMD ["aenv", "server", "--host", "0.0.0.0"]',
         "-", tag], env=engine.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    assert proc.stdin is not None
    with open(base_tar, "rb") as f:
        left = end
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            proc.stdin.write(chunk)
            left -= len(chunk)
    _, err = proc.communicate(layer, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"docker import: {err.decode()[-2000:]}")
