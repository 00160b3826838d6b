"""Low-level network-namespace helpers: create, enter, remove, list.

Entering a netns with ``setns(2)`` changes only the calling *thread*, so every
operation that enters one runs in a short-lived thread of its own
(:func:`run_in_thread`) and restores the thread's original netns before it
ends. A process spawned from such a thread (``iptables-restore``) inherits the
netns the thread is in at spawn time; sockets (netlink included) stay bound to
the netns they were created in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_rundir_ready = False
_rundir_lock = threading.Lock()


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _ensure_rundir() -> None:
    """Make NETNS_DIR a shared mount point, as ``ip netns add`` does."""
    global _rundir_ready
    with _rundir_lock:
        if _rundir_ready:
            return
        os.makedirs(NETNS_DIR, exist_ok=True)
        run = NETNS_DIR.encode()
        if _libc.mount(b"", run, b"none", MS_SHARED | MS_REC, None) != 0:
            _check(_libc.mount(run, run, b"none", MS_BIND | MS_REC, None), "bind netns dir")
            _check(_libc.mount(b"", run, b"none", MS_SHARED | MS_REC, None), "share netns dir")
        _rundir_ready = True


@contextlib.contextmanager
def _restoring_netns() -> Iterator[None]:
    """Return the calling thread to the netns it is in now when the block ends."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield
    finally:
        try:
            _check(_libc.setns(home, CLONE_NEWNET), "setns back to home netns")
        finally:
            os.close(home)


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the block with the calling thread inside netns ``name``."""
    fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        with _restoring_netns():
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns {name}")
            yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def created(name: str) -> Iterator[None]:
    """Create netns ``name`` (bound at /var/run/netns/name) and run the block inside it.

    Raises FileExistsError when the name is taken.
    """
    _ensure_rundir()
    path = netns_path(name)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    with _restoring_netns():
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare netns")
            _check(
                _libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND, None),
                f"bind netns {name}",
            )
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        yield


def remove(name: str) -> bool:
    """Unmount and unlink netns ``name``; True if it existed."""
    path = netns_path(name)
    if not os.path.lexists(path):
        return False
    if _libc.umount2(path.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


def write_sysctl(key: str, value: str) -> None:
    """Write a sysctl of the calling thread's netns (``net.ipv4.ip_forward`` style key)."""
    with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(value)


def iptables_restore(text: str, noflush: bool = True) -> None:
    """Apply ``text`` with one iptables-restore process in the calling thread's netns."""
    args = ["iptables-restore", "-w"]
    if noflush:
        args.append("--noflush")
    proc = subprocess.run(args, input=text.encode(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"iptables-restore failed ({proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}\n--- input ---\n{text}"
        )


def iptables_save() -> str:
    proc = subprocess.run(["iptables-save"], capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"iptables-save failed: {proc.stderr.decode(errors='replace')}")
    return proc.stdout.decode()


async def run_in_thread(fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` in a fresh thread (never a pooled one: it may setns)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def _set(result: T | None, exc: BaseException | None) -> None:
        if fut.cancelled():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def _target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(_set, None, exc)
        else:
            loop.call_soon_threadsafe(_set, result, None)

    threading.Thread(target=_target, name="aenv-net", daemon=True).start()
    # Shield: a cancelled caller must not leave the netlink work half-observed.
    return await asyncio.shield(fut)
