"""Small images for tests: a layer of a few tools from the base rootfs (bash,
coreutils) and their shared libraries, enough for envd's bundle and build steps."""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path

from .nodes import SHARED_HOME

BASE = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
# What RUN and COPY need in an image: bash and the tools the COPY step uses.
TOOLS = ["bash", "sh", "cat", "echo", "ls", "tar", "gzip", "cp", "chown", "chmod", "mkdir", "rm",
         "basename", "dirname", "id", "whoami", "env", "sleep", "test", "true", "mv"]


def tools_layer(mountpoint: bool = True) -> bytes:
    """A layer of a few binaries from the base rootfs and their shared libraries.

    ``mountpoint``: with /.aenv, where envd's bundle is mounted. Without it (and
    without /proc, /dev, /sys, /tmp) the image still starts: the layer store puts
    a layer of mount points under every image's read-only rootfs mount."""
    files: set[str] = set()
    for tool in TOOLS:
        path = f"usr/bin/{tool}"
        if (BASE / path).exists():
            files.add(path)
            out = subprocess.run(["ldd", str(BASE / path)], capture_output=True, text=True).stdout
            for lib in re.findall(r"(/\S+\.so[.\d]*)", out):
                name = Path(lib).name
                for cand in (f"usr/lib/x86_64-linux-gnu/{name}", f"usr/lib64/{name}"):
                    if (BASE / cand).exists():
                        files.add(cand)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ([".aenv"] if mountpoint else []) + [
                "usr", "usr/bin", "usr/lib", "usr/lib/x86_64-linux-gnu", "usr/lib64", "etc",
                "tmp", "root", "opt"]:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for path in sorted(files):
            tar.add(str((BASE / path).resolve()), arcname=path)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"),
                           ("etc/group", "root:x:0:\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()
