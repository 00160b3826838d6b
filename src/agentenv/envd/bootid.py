"""The sandbox's boot ID (``/proc/sys/kernel/random/boot_id``), one per boot.

gVisor draws it when its kernel starts and a checkpoint keeps it, so every sandbox
restored from one template image would share it. envd, as the sandbox's init, puts
a small tmpfs over ``/proc/sys/kernel/random`` at start-up holding the kernel's
value, then gives up CAP_SYS_ADMIN (the only thing it held it for) for good. The
node names a new boot at ``/init`` (a create); a fork or a resume continues the same
boot and names none, and the file, being in the sandbox's memory, goes with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import uuid

log = logging.getLogger("envd")

DIR = "/proc/sys/kernel/random"
FILE = DIR + "/boot_id"
CAP_SYS_ADMIN = 21
PR_CAPBSET_DROP = 24
_CAP_VERSION_3 = 0x20080522
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _drop_sys_admin(libc: ctypes.CDLL) -> None:
    """Out of envd's bounding, permitted, effective and inheritable sets: nothing it
    runs or forks can mount afterwards."""
    _check(libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0), "PR_CAPBSET_DROP")
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    keep = ~(1 << CAP_SYS_ADMIN) & 0xFFFFFFFF
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & keep)
    _check(libc.capset(ctypes.byref(header), data), "capset")


def prepare() -> None:
    """At start-up, as the sandbox's pid 1 only (never on a host): the tmpfs with the
    kernel's boot ID and the layer keeper (layers.py), then CAP_SYS_ADMIN is dropped
    whatever happened."""
    if os.getpid() != 1 or os.geteuid() != 0:
        return
    libc = _libc()
    try:
        if _take_over_boot_id(libc):
            # The one helper that keeps the capability, to mount files layers for envd
            # (first start only: a restarted envd finds it running).
            from .layers import LAYERS, start_keeper

            LAYERS.keeper_pid = start_keeper()
    except OSError as e:
        log.warning("boot ID or layer keeper: %s", e)
    finally:
        try:
            _drop_sys_admin(libc)
        except OSError as e:
            log.warning("boot ID: dropping CAP_SYS_ADMIN failed: %s", e)


def _take_over_boot_id(libc: ctypes.CDLL) -> bool:
    """The tmpfs over DIR with the kernel's boot ID in it; False when it was done
    before (envd started again in this boot)."""
    with open(FILE) as f:
        current = f.read().strip()
    if os.path.ismount(DIR):
        return False
    try:
        _check(libc.mount(b"tmpfs", DIR.encode(), b"tmpfs",
                          _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=16k,mode=0555"),
               "mount tmpfs")
        _write(current)
    except OSError as e:
        log.warning("boot ID: cannot take over %s (%s); it stays the kernel's", DIR, e)
    return True


def _write(value: str) -> None:
    tmp = f"{DIR}/.boot_id.new"
    # Beside the old one, then renamed over it: a reader sees one or the other whole
    # (the tmpfs has a page for each).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
    try:
        os.write(fd, (value + "\n").encode())
        os.close(fd)
        os.chmod(tmp, 0o444)
        os.rename(tmp, FILE)
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def canonical(value: object) -> str:
    """The boot ID's usual form (lower-case, hyphenated); ValueError unless a UUID."""
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("bootID must be a UUID")
    return str(uuid.UUID(value))


def set_boot_id(value: str) -> None:
    """A new boot's ID (``/init`` of a created sandbox), in canonical form; OSError
    when there is no tmpfs of envd's to hold it."""
    if not os.path.ismount(DIR):
        raise OSError(f"{DIR} is not envd's")
    _write(value)
