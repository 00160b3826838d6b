"""Starting a command as another user without forking envd.

CPython cannot vfork when asked to change uid/gid, so ``Popen(user=...)`` copies
the whole envd process: ~30 ms per command under gVisor against ~5 ms for a
vfork. Instead envd vforks a helper that sets the groups, gid and uid and execs
the command: the bundle's ``exec-as`` (exec_as.c, no libc: ~1 ms under gVisor),
else util-linux's ``setpriv`` (in the bundle with its libraries: ~12 ms, most of
it the loader and libc start-up faulting pages in), else the host's setpriv.
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
def exec_as() -> str | None:
    """The bundle's exec-as, when envd runs from a bundle that has one."""
    helper = Path(sys.prefix).parent / "bin" / "exec-as"  # PYTHONHOME is <bundle>/python
    return str(helper) if os.access(helper, os.X_OK) else None


@functools.cache
def setpriv_prefix() -> tuple[str, ...] | None:
    """How to run setpriv here: from the bundle inside a sandbox, else the host's."""
    bundle = Path(sys.prefix).parent
    setpriv, loader = bundle / "bin" / "setpriv", bundle / "lib" / LOADER
    if setpriv.is_file() and loader.is_file():
        return (str(loader), "--library-path", str(bundle / "lib"), str(setpriv))
    host = shutil.which("setpriv")
    return (host,) if host else None


def as_user(argv: list[str], uid: int, gid: int, groups: list[int], path: str,
            enter: tuple[str, int] | None = None) -> list[str] | None:
    """argv that runs ``argv`` with these credentials via exec-as or setpriv, or None
    if neither is here.

    ``enter`` (a directory, a descriptor) asks exec-as to change into the directory
    as the user and report the outcome on the descriptor (exec_as.c); only exec-as
    can, so pass it only when ``exec_as()`` is here.

    Raises FileNotFoundError / PermissionError for a command that cannot be run,
    as Popen would, since the helper would only report it after the fork.
    """
    helper = exec_as()
    prefix = setpriv_prefix() if helper is None else None
    if helper is None and prefix is None:
        return None
    _check_executable(argv[0], path)
    if helper is not None:
        where = ["-C", enter[0], str(enter[1])] if enter is not None else []
        return [helper, *where, str(uid), str(gid), ",".join(str(g) for g in groups) or "-",
                *argv]
    assert prefix is not None and enter is None
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
