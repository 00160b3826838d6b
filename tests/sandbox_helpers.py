"""Helpers shared by tests that check a sandbox's processes keep running."""

from __future__ import annotations

import time

from e2b import Sandbox

# A Python loop (no fork per tick, cheap on a loaded machine) writing a counter.
COUNTER = (
    "python3 -c 'import itertools, time\n"
    "for i in itertools.count():\n"
    "    open(\"/tmp/count\", \"w\").write(str(i)); time.sleep(0.05)'"
)


def count(sbx: Sandbox) -> int:
    return int(sbx.commands.run("cat /tmp/count 2>/dev/null || echo 0").stdout or 0)


def counting(sbx: Sandbox) -> bool:
    """The counter loop advances (allowing for a loaded machine)."""
    first = count(sbx)
    for _ in range(50):
        time.sleep(0.1)
        if count(sbx) > first:
            return True
    return False
