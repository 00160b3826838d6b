"""Starting a command as another user without forking envd.

CPython cannot vfork when asked to change uid/gid, so ``Popen(user=...)`` copies
the whole envd process: ~30 ms per command under gVisor against ~5 ms for a
vfork. Instead envd vforks util-linux's ``setpriv`` (shipped in the runtime
bundle with its libraries), which sets the groups, gid and uid and execs the
command.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import sys
from pathlib import Path

LOADER = "ld-linux-x86-64.so.2"


@functools.cache
def setpriv_prefix() -> tuple[str, ...] | None:
    """How to run setpriv here: from the bundle inside a sandbox, else the host's."""
    bundle = Path(sys.prefix).parent  # PYTHONHOME is <bundle>/python
    setpriv, loader = bundle / "bin" / "setpriv", bundle / "lib" / LOADER
    if setpriv.is_file() and loader.is_file():
        return (str(loader), "--library-path", str(bundle / "lib"), str(setpriv))
    host = shutil.which("setpriv")
    return (host,) if host else None


def as_user(argv: list[str], uid: int, gid: int, groups: list[int], path: str) -> list[str] | None:
    """argv that runs ``argv`` with these credentials via setpriv, or None if unavailable.

    Raises FileNotFoundError / PermissionError for a command that cannot be run,
    as Popen would, since setpriv would only report it after the fork.
    """
    prefix = setpriv_prefix()
    if prefix is None:
        return None
    _check_executable(argv[0], path)
    group_arg = ["--groups", ",".join(str(g) for g in groups)] if groups else ["--clear-groups"]
    return [*prefix, f"--reuid={uid}", f"--regid={gid}", *group_arg, "--", *argv]


def _check_executable(cmd: str, path: str) -> None:
    if "/" in cmd:
        if not os.path.exists(cmd):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd)
        if os.path.isdir(cmd) or not os.access(cmd, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), cmd)
        return
    if shutil.which(cmd, path=path) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd)
