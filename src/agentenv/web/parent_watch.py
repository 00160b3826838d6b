"""Stop a server when the process that started it ends (``AENV_EXIT_WITH_PARENT``).

Tests and benchmarks start nodes in sessions of their own (so that a stop reaches the
whole process group): a test or benchmark killed with its shell then left its node, and
the node its sandboxes, running for as long as nobody looked (80 minutes once, 100
sandboxes). Given the starter's PID, the server watches it through a pidfd and, when it
ends, stops as on ``SIGTERM``: gracefully, ending its sandboxes."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

log = logging.getLogger(__name__)
ENV = "AENV_EXIT_WITH_PARENT"


def watch_parent_from_env() -> None:
    """Start the watch if ``AENV_EXIT_WITH_PARENT`` names a PID; nothing otherwise."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return
    if not value.isdigit() or int(value) <= 1:
        raise ValueError(f"{ENV} must be the PID of the process to exit with, not {value!r}")
    watch_parent(int(value))


def watch_parent(pid: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        _stop(pid)
        return
    threading.Thread(target=_wait, args=(pid, pidfd), name="parent-watch", daemon=True).start()


def _wait(pid: int, pidfd: int) -> None:
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)  # readable once the process has ended
    while not poll.poll():
        pass
    os.close(pidfd)
    _stop(pid)


def _stop(pid: int) -> None:
    log.warning("process %d that started this server ended: stopping", pid)
    os.kill(os.getpid(), signal.SIGTERM)
