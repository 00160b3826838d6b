"""Real gVisor checkpoint images for storage tests and benchmarks.

A bare runsc sandbox (no network, root overlay in memory) holds ``mib`` MiB of
random data in a Python process; it is checkpointed, 1 MiB is written to a file
inside it, and it is checkpointed again. Nothing of it is left afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path


def bare_sandbox(work: Path, rootfs: Path, argv: list[str]) -> tuple[list[str], Path]:
    """An OCI bundle for ``argv`` over ``rootfs`` (root overlay in memory, no network),
    and the runsc command prefix (own state dir under ``work``) to run it with."""
    runsc = shutil.which("runsc") or "/usr/bin/runsc"
    root, bundle = work / "state", work / "bundle"
    root.mkdir(parents=True)
    bundle.mkdir()
    subprocess.run([runsc, "spec", "--bundle", str(bundle), "--", *argv], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": False}
    spec["process"]["terminal"] = False
    (bundle / "config.json").write_text(json.dumps(spec))
    return [runsc, f"--root={root}", "--network=none", "--overlay2=root:memory"], bundle


def two_checkpoints(work: Path, rootfs: Path, mib: int, change_kib: int = 1024
                    ) -> tuple[Path, Path]:
    """``(first, second)`` image directories under ``work``: a process holding ``mib``
    MiB of random data, then ``change_kib`` KiB written to a file between the two."""
    cid = f"ckpt-{uuid.uuid4().hex[:8]}"
    program = (f"import os, time\nkeep = os.urandom({mib} << 20)\n"
               "open('/tmp/ready', 'w').close()\ntime.sleep(1e9)\n")
    base, bundle = bare_sandbox(work, rootfs, ["/usr/bin/python3", "-c", program])
    log = work / "runsc.err"

    def run(*args: str) -> None:
        # Never a pipe: a detached sandbox would keep it open for its whole life.
        with open(log, "ab") as err:
            code = subprocess.run([*base, *args], timeout=120, stdin=subprocess.DEVNULL,
                                  stdout=err, stderr=err).returncode
        if code:
            raise RuntimeError(f"runsc {args[0]} failed: {log.read_text()[-2000:]}")

    try:
        run("run", "--detach", "--bundle", str(bundle), cid)
        run("exec", cid, "/bin/sh", "-c",
            "for i in $(seq 600); do [ -e /tmp/ready ] && exit 0; sleep 0.05; done; exit 1")
        first, second = work / "ck1", work / "ck2"
        run("checkpoint", "--image-path", str(first), "--leave-running", "--compression=none",
            cid)
        run("exec", cid, "/bin/sh", "-c",
            f"head -c {change_kib << 10} /dev/urandom > /root/change.bin")
        run("checkpoint", "--image-path", str(second), "--leave-running", "--compression=none",
            cid)
        return first, second
    finally:
        subprocess.run([*base, "kill", cid, "KILL"], check=False, capture_output=True)
        subprocess.run([*base, "delete", "--force", cid], check=False, capture_output=True)
