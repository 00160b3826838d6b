"""Resets in filesystem mode (issue 28): ``POST /sandboxes/{id}/reset`` with ``{"mode":
"filesystem"}``. The first reset to a snapshot is a full one (its answer says ``mode:
memory``); from the second on, while the sandbox runs, the files go back to the
snapshot's in place (``mode: filesystem``): no restore, the same kernel, slot, ID and
tokens. What the user does goes through the official e2b SDK, as a harness would."""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node
from sandbox_helpers import base_template_with

SERVICE = "sleep 86400"  # started before the snapshot: the task's service
ROLLOUT = "sleep 86399"  # started by a rollout


def reset(api: httpx.Client, sid: str, snap: str, mode: str = "filesystem") -> dict:
    r = api.post(f"/sandboxes/{sid}/reset", json={"snapshotID": snap, "mode": mode})
    assert r.status_code == 200, r.text
    assert r.json()["sandboxID"] == sid
    return r.json()


def snapshot(api: httpx.Client, sid: str) -> str:
    r = api.post(f"/sandboxes/{sid}/snapshots", json={})
    assert r.status_code == 201, r.text
    return r.json()["snapshotID"]


def pid_of(sbx: Sandbox, pattern: str) -> str:
    return sbx.commands.run(f"pgrep -fx '{pattern}' || true").stdout.strip()


def rollout(sbx: Sandbox, n: int) -> None:
    """What a rollout does to a task: edits, new files, deletions, as the user and as
    root (sudo), in /tmp, through the files API, and processes left behind."""
    sbx.files.write("/home/user/repo/main.py", f"print('patched {n}')\n")
    sbx.files.write("/home/user/new.txt", "made by the rollout")
    # A listing runs in a file worker (the quick operations are envd's own): one is up.
    assert "main.py" in {e.name for e in sbx.files.list("/home/user/repo")}
    sbx.commands.run("rm /home/user/repo/test_main.py && echo x > /tmp/rollout.txt "
                     "&& rm /tmp/setup.txt && mkdir -p /home/user/build/a/b")
    sbx.commands.run("sudo sh -c 'echo rollout > /etc/rollout.conf && rm /etc/hostname.bak'")
    sbx.commands.run(ROLLOUT, background=True)
    sbx.commands.run(f"setsid nohup {ROLLOUT} >/dev/null 2>&1 &")  # escaped envd's tree
    assert pid_of(sbx, ROLLOUT)


def file_workers(sbx: Sandbox) -> set[str]:
    """envd's file workers: copies of envd (pid 1) that serve the files API."""
    pids = sbx.commands.run("pgrep -f 'm agentenv[.]envd --port' || true").stdout.split()
    return set(pids) - {"1"}


def at_the_snapshot(sbx: Sandbox, service_pid: str) -> None:
    # Through the files API first, right after the reset: a file of the rollout's
    # (written by it, removed by the reset) is gone there too, not only for commands.
    assert not sbx.files.exists("/home/user/new.txt")
    assert sbx.files.read("/home/user/repo/main.py") == "print('setup')\n"
    assert sbx.files.read("/home/user/repo/test_main.py") == "assert True\n"
    assert sbx.files.read("/tmp/setup.txt") == "from the setup"
    ls = sbx.commands.run("ls -A /home/user; ls /tmp; stat -c '%U %a' /home/user /tmp; "
                          "cat /etc/hostname.bak; test ! -e /etc/rollout.conf && echo clean")
    assert "new.txt" not in ls.stdout and "build" not in ls.stdout
    assert "rollout.txt" not in ls.stdout
    assert "user 7" in ls.stdout and "root 1777" in ls.stdout  # owners and modes kept
    assert "backup" in ls.stdout and "clean" in ls.stdout
    assert pid_of(sbx, ROLLOUT) == ""  # every process of the rollout ended
    assert pid_of(sbx, SERVICE) == service_pid  # the task's service runs on


def test_files_go_back_in_place_processes_of_the_rollout_end_the_service_stays(
        node: Node, api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    try:
        sbx.commands.run("mkdir -p /home/user/repo && cd /home/user/repo && "
                         "echo \"print('setup')\" > main.py && echo 'assert True' > test_main.py"
                         " && echo -n 'from the setup' > /tmp/setup.txt && "
                         "sudo sh -c 'echo backup > /etc/hostname.bak'")
        sbx.commands.run(SERVICE, background=True, timeout=0)
        service = pid_of(sbx, SERVICE)
        assert service
        snap = snapshot(api, sid)

        # The first reset to the snapshot restores it (and layers its files).
        first = reset(api, sid, snap)
        assert first["mode"] == "memory"
        at_the_snapshot(sbx, service)
        for n in range(3):
            rollout(sbx, n)
            workers = file_workers(sbx)
            assert workers  # the rollout's listing left one
            if n == 1:  # root killed them: the reset and the files API do without
                sbx.commands.run(f"sudo kill -9 {' '.join(workers)}")
            done = reset(api, sid, snap)
            assert done["mode"] == "filesystem", done
            # The same SDK object goes on working: same ID, same envd token.
            at_the_snapshot(sbx, service)
            # The file worker followed the root into the reset files: not ended and
            # forked anew (that was most of a files reset's CPU). Requests that overlap
            # may fork a second one beside it (two per user): a loaded run did.
            after = file_workers(sbx)
            if n == 1:
                assert not after & workers, (workers, after)
            else:
                assert workers <= after, (workers, after)
        assert sbx.commands.run("python3 /home/user/repo/main.py").stdout == "setup\n"
        # The sandbox's history (its lineage) says what each reset did.
        me = api.get(f"/snapshots/{snap}/lineage").json()["ancestors"][1]
        assert me["id"] == sid
        assert [r["mode"] for r in me["resets"]] == ["memory"] + ["filesystem"] * 3
    finally:
        sbx.kill()


def test_processes_forking_as_the_reset_kills_them_all_end(
        node: Node, api: httpx.Client) -> None:
    """A rollout that leaves processes forking as fast as they can (their children
    orphaned to envd, a session of their own): the reset's kill pass races them, and
    still ends every one, then the sandbox works on in the reset files."""
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    try:
        sbx.commands.run(SERVICE, background=True)
        service = pid_of(sbx, SERVICE)
        snap = snapshot(api, sid)
        assert reset(api, sid, snap)["mode"] == "memory"
        for _ in range(2):
            sbx.commands.run("setsid nohup sh -c 'while :; do (sleep 86397 &); done' "
                             ">/dev/null 2>&1 & setsid nohup sh -c 'while :; do sleep 86396 & "
                             "done' >/dev/null 2>&1 &")
            sbx.commands.run("sleep 0.3; echo forked > /home/user/left.txt")
            assert int(sbx.commands.run("pgrep -c -f 'sleep 8639[67]'").stdout) > 2
            done = reset(api, sid, snap)
            assert done["mode"] == "filesystem", done
            left = sbx.commands.run("pgrep -fa 'sleep 8639[67]|[w]hile :' || true").stdout
            assert left.strip() == ""
            assert pid_of(sbx, SERVICE) == service
            assert sbx.commands.run("ls /home/user").stdout.count("left.txt") == 0
    finally:
        sbx.kill()


def version(sbx: Sandbox) -> str:
    return sbx.commands.run("cat /home/user/v.txt; ls /home/user").stdout


def test_layers_nest_survive_pause_and_fork_and_each_child_resets_alone(
        api: httpx.Client) -> None:
    """A snapshot taken inside a layer is one more layer when reset to; a reset to the
    first drops the layer above. A pause and resume keeps the layers; so does a fork,
    whose children then reset their own files in place."""
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    children: list[str] = []
    try:
        sbx.files.write("/home/user/v.txt", "v0")
        s1 = snapshot(api, sid)
        assert reset(api, sid, s1)["mode"] == "memory"
        sbx.files.write("/home/user/v.txt", "v1")
        s2 = snapshot(api, sid)  # its files are v0 + this layer's v1
        sbx.files.write("/home/user/junk.txt", "junk")
        assert reset(api, sid, s2)["mode"] == "memory"  # no layer for s2 yet
        assert version(sbx) == "v1v.txt\n"
        sbx.files.write("/home/user/v.txt", "v2")
        assert reset(api, sid, s2)["mode"] == "filesystem"
        assert version(sbx) == "v1v.txt\n"
        assert reset(api, sid, s1)["mode"] == "filesystem"  # the layer below, in place
        assert version(sbx) == "v0v.txt\n"

        sbx.files.write("/home/user/v.txt", "before the pause")
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        r = api.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 201, r.text
        assert version(sbx) == "before the pausev.txt\n"
        assert reset(api, sid, s1)["mode"] == "filesystem"
        assert version(sbx) == "v0v.txt\n"

        sbx.files.write("/home/user/v.txt", "parent")
        r = api.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        children = [c["sandbox"]["sandboxID"] for c in r.json()]
        kids = [Sandbox.connect(c) for c in children]
        kids[0].files.write("/home/user/v.txt", "child 0")
        assert reset(api, children[0], s1)["mode"] == "filesystem"
        assert version(kids[0]) == "v0v.txt\n"
        assert version(kids[1]) == "parentv.txt\n"  # its sibling's reset is not its own
        assert version(sbx) == "parentv.txt\n"

        # A files-only pause captures what the layered sandbox sees, and the resumed
        # (rebooted) sandbox has no layer: its next reset is a full one.
        assert api.post(f"/sandboxes/{sid}/pause", json={"memory": False}).status_code == 204
        assert api.post(f"/sandboxes/{sid}/resume", json={}).status_code == 201
        assert version(sbx) == "parentv.txt\n"
        assert sbx.commands.run("ls -a /").stdout.count(".aenv-layers") == 0
        assert reset(api, sid, s1)["mode"] == "memory"
        assert version(sbx) == "v0v.txt\n"
    finally:
        for c in children:
            api.delete(f"/sandboxes/{c}")
        sbx.kill()


def test_what_a_files_reset_cannot_do_is_a_full_one_and_bad_input_a_clear_error(
        node: Node, api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=600)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/v.txt", "v0")
        snap = snapshot(api, sid)
        for bad in ({"mode": "files"}, {"mode": ""}, {"mode": 1}, {"mode": None}):
            r = api.post(f"/sandboxes/{sid}/reset", json={"snapshotID": snap, **bad})
            assert r.status_code == 400, (bad, r.text)
            assert "mode" in r.text
        assert reset(api, sid, snap)["mode"] == "memory"

        # Root in the sandbox cannot mount, nor unmount its layer (only envd's keeper
        # can), and killing the keeper makes the next reset a full one, not a failure.
        capable = sbx.commands.run(
            "for s in /proc/[0-9]*/status; do eff=$(awk '/^CapEff/ {print $2}' $s); "
            "[ $(( 0x$eff >> 21 & 1 )) = 1 ] && awk '/^Name/ {print $2}' $s; done; true")
        assert capable.stdout.split() == ["layer-keeper"], capable.stdout
        for cmd in ("mount -t tmpfs none /mnt", "umount -l /", "umount -l /tmp"):
            run = sbx.commands.run(f"sudo {cmd}; echo rc=$?")
            assert "rc=0" not in run.stdout, cmd
        sbx.files.write("/home/user/v.txt", "v1")
        sbx.commands.run("sudo pkill -9 -x layer-keeper; true")
        assert sbx.commands.run("pgrep -x layer-keeper || echo gone").stdout.strip() == "gone"
        assert reset(api, sid, snap)["mode"] == "memory"
        assert version(sbx) == "v0v.txt\n"
        sbx.files.write("/home/user/v.txt", "v2")
        # The restored snapshot brought its keeper back: in place again.
        assert reset(api, sid, snap)["mode"] == "filesystem"
        assert version(sbx) == "v0v.txt\n"

        # A paused sandbox is reset in full (and runs), then in place again.
        sbx.files.write("/home/user/v.txt", "v3")
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert reset(api, sid, snap)["mode"] == "memory"
        assert version(sbx) == "v0v.txt\n"
        assert reset(api, sid, snap)["mode"] == "filesystem"
        assert node.client().get("/health").status_code == 200
    finally:
        sbx.kill()


@pytest.mark.parametrize("access", ["root", "user"])
def test_envd_answers_its_layer_api_only_with_the_token_and_bounded_input(
        api: httpx.Client, node: Node, access: str) -> None:
    """envd's /aenv/layer, reached through the node's proxy as a client inside or
    outside could: no token, 401; a hostile tag or op, 400; an unknown tag, 409."""
    sbx = Sandbox.create("base", timeout=300)
    try:
        envd = httpx.Client(base_url=node.url, timeout=30, headers={
            "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})
        token = {"X-Access-Token": sbx._envd_access_token} if access == "root" else {}
        r = envd.post("/aenv/layer", json={"op": "push", "tag": "x"}, headers=token)
        if access == "user":
            assert r.status_code == 401
            return
        assert r.status_code == 200 and r.json()["depth"] == 1, r.text
        for bad in ({"op": "push", "tag": "../../x"}, {"op": "push", "tag": "x" * 200},
                    {"op": "drop", "tag": "x"}, {"op": "push"}, ["push"], "push"):
            r = envd.post("/aenv/layer", json=bad, headers=token)
            assert r.status_code == 400, (bad, r.text)
        r = envd.post("/aenv/layer", content=b"{" * 10000, headers=token)
        assert r.status_code in (400, 413)
        r = envd.post("/aenv/layer", json={"op": "reset", "tag": "nope"}, headers=token)
        assert r.status_code == 409 and "no files layer" in r.json()["message"]
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_the_disk_budget_holds_in_a_layer_and_a_reset_gives_the_space_back(
        node: Node, api: httpx.Client) -> None:
    """A 64 MB template: in a files layer, files written to / and /tmp together stay
    within the budget (the layer's tmpfs has /tmp's size, envd's guard counts the real
    layers and the files layer), the sandbox lives, and the next reset frees it all."""
    sbx = Sandbox.create(base_template_with(node, "fsr-disk64", cpuCount=1, memoryMB=512,
                                            diskSizeMB=64), timeout=300)
    sid = sbx.sandbox_id
    try:
        snap = snapshot(api, sid)
        assert reset(api, sid, snap)["mode"] == "memory"
        fill = ("for i in 1 2 3 4; do dd if=/dev/zero of=/tmp/f$i bs=1M count=40 "
                "2>/dev/null; dd if=/dev/zero of=/home/user/f$i bs=1M count=40 2>/dev/null;"
                " done; du -smc /tmp /home/user 2>/dev/null | tail -1 | cut -f1")
        written = int(sbx.commands.run(fill, timeout=120).stdout.strip() or 0)
        assert 0 < written <= 64 + 16, written  # the budget (and what one file overshoots)
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert reset(api, sid, snap)["mode"] == "filesystem"
        r = sbx.commands.run("ls /tmp /home/user; dd if=/dev/zero of=/home/user/g bs=1M "
                             "count=40 2>&1 >/dev/null; echo rc=$?")
        assert "f1" not in r.stdout and "rc=0" in r.stdout, r.stdout
    finally:
        sbx.kill()
        api.delete("/templates/fsr-disk64")
