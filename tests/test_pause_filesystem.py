"""Filesystem-only pauses through the official e2b SDK: ``pause(mode="filesystem")``
(the API's ``memory: false``), the lifecycle's ``on_timeout: {action: pause, mode:
filesystem}`` and ``connect(on_resume="reboot")``. A resume reboots the sandbox: no
old processes, a fresh uptime and boot, and every file change kept (new, changed,
deleted, renamed files, modes, owners, links, /tmp)."""

from __future__ import annotations

import time

import pytest
from e2b import InvalidArgumentException, Sandbox, SandboxException

from agentenv.testing import Node

CHANGES = r"""
set -e
mkdir -p /home/user/work/deep/er
printf 'kept %s\n' one > /home/user/work/deep/er/a.txt
head -c 3000000 /dev/urandom > /home/user/work/blob.bin
sha256sum /home/user/work/blob.bin | cut -d' ' -f1 > /home/user/work/blob.sum
ln -s deep/er/a.txt /home/user/work/link
mkfifo /home/user/work/fifo
chmod 640 /home/user/work/deep/er/a.txt
echo 'in tmp' > /tmp/t.txt
"""
AS_ROOT = r"""
set -e
echo changed-by-root >> /etc/motd; rm /etc/issue; mv /etc/issue.net /etc/issue.moved
chown 1234:2345 /home/user/work/blob.sum; rm -r /usr/share/doc/bash
rm /usr/bin/rgrep; ln -s /bin/true /usr/bin/rgrep
"""

CHECKS = r"""
set -ex
test "$(cat /home/user/work/deep/er/a.txt)" = 'kept one'
test "$(sha256sum /home/user/work/blob.bin | cut -d' ' -f1)" = "$(cat /home/user/work/blob.sum)"
test "$(readlink /home/user/work/link)" = deep/er/a.txt
test -p /home/user/work/fifo
test "$(stat -c %a /home/user/work/deep/er/a.txt)" = 640
test "$(stat -c %u:%g /home/user/work/blob.sum)" = 1234:2345
test "$(stat -c %U /home/user/work/deep/er/a.txt)" = user
test "$(cat /tmp/t.txt)" = 'in tmp'
tail -n1 /etc/motd | grep -qx changed-by-root
test ! -e /etc/issue && test -e /etc/issue.moved && test ! -e /etc/issue.net
test ! -e /usr/share/doc/bash
test "$(readlink /usr/bin/rgrep)" = /bin/true
echo ok
"""


def _boot(sbx: Sandbox) -> tuple[str, float, str]:
    out = sbx.commands.run("cat /proc/sys/kernel/random/boot_id; cut -d' ' -f1 /proc/uptime; "
                           "pgrep -f '^sleep 4242' || true").stdout.split("\n")
    return out[0], float(out[1]), out[2].strip()


def test_pause_without_memory_reboots_with_every_file_kept(node: Node) -> None:
    sbx = Sandbox.create("base", timeout=300)
    try:
        r = sbx.commands.run(CHANGES, timeout=60)
        assert r.exit_code == 0, r.stderr
        r = sbx.commands.run(AS_ROOT, user="root")
        assert r.exit_code == 0, r.stderr
        sbx.commands.run("sleep 4242", background=True, timeout=0)
        boot_id, _, sleeper = _boot(sbx)
        assert sleeper

        paused_at = time.monotonic()
        assert sbx.pause(mode="filesystem")
        assert sbx.get_info().state.value == "paused"
        Sandbox.connect(sbx.sandbox_id, timeout=300)

        r = sbx.commands.run(CHECKS)
        assert r.stdout.strip() == "ok", r.stderr
        new_boot, uptime, sleeper = _boot(sbx)
        # Rebooted: its kernel started after the pause, nothing of the old run is left.
        assert sleeper == "" and uptime < time.monotonic() - paused_at
        assert new_boot != boot_id
        # The reboot is a real one: the template's user and envd serve as before.
        assert sbx.commands.run("whoami").stdout.strip() == "user"
        assert sbx.files.read("/home/user/work/deep/er/a.txt") == "kept one\n"

        # Paused again, with memory: the rebooted sandbox pauses and resumes as any other.
        sbx.commands.run("sleep 4242", background=True, timeout=0)
        sbx.pause()
        Sandbox.connect(sbx.sandbox_id)
        assert _boot(sbx)[2]  # a memory pause keeps the processes
    finally:
        sbx.kill()


def test_timeout_pauses_without_memory_when_the_lifecycle_says_so(node: Node) -> None:
    sbx = Sandbox.create("base", timeout=4, lifecycle={
        "on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        sbx.files.write("/home/user/note.txt", "before the timeout")
        sbx.commands.run("sleep 4242", background=True, timeout=0)
        deadline = time.time() + 60
        while sbx.get_info().state.value != "paused":
            assert time.time() < deadline, "the sandbox was not paused at its timeout"
            time.sleep(0.5)
        Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert sbx.files.read("/home/user/note.txt") == "before the timeout"
        assert _boot(sbx)[2] == ""  # its processes are gone: it rebooted
    finally:
        sbx.kill()


def test_what_cannot_be_done_is_a_clear_error(node: Node) -> None:
    with pytest.raises(InvalidArgumentException):  # the SDK's own rule
        Sandbox.create("base", lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"},
                                          "auto_resume": True})
    sbx = Sandbox.create("base", timeout=120)
    try:
        sbx.pause()
        # A memory pause has its files only inside its memory image.
        with pytest.raises(SandboxException, match="paused with its memory"):
            Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
        assert sbx.get_info().state.value == "paused"
        Sandbox.connect(sbx.sandbox_id)
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_a_filesystem_snapshot_boots_new_sandboxes_with_its_files(node: Node, api) -> None:
    sbx = Sandbox.create("base", timeout=120)
    try:
        sbx.files.write("/home/user/seed.txt", "from the snapshot")
        sbx.commands.run("sleep 4242", background=True, timeout=0)
        snap = sbx.create_snapshot(mode="filesystem")
        assert _boot(sbx)[2]  # the source runs on, its processes too
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        try:
            assert child.files.read("/home/user/seed.txt") == "from the snapshot"
            assert _boot(child)[2] == ""  # booted: none of the source's processes
            assert _boot(child)[0] != _boot(sbx)[0]
        finally:
            child.kill()
        assert api.delete(f"/snapshots/{snap.snapshot_id}").status_code == 204
    finally:
        sbx.kill()
