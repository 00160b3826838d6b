"""Memory the host counts and the guest does not (issue 12, finding 6).

A sandbox's host cgroup holds gVisor's sentry as well as the workload; past its
limit the host OOM-kills the whole sandbox. Ordinary workloads got there: files
in /tmp (gVisor's in-memory tmpfs), each under RLIMIT_FSIZE but together past
memory, and many loopback sockets (sentry memory the guest's ``free`` never
shows) followed by the next workload. Each time the node kept saying
``running`` and SDK calls hung to their timeout.

Now: /tmp has a size, / and /tmp share envd's quota, the node tells envd to free
memory when the cgroup nears its limit, and when a sandbox's runtime ends anyway
the sandbox is ``error`` at once, with the reason, and calls to it fail fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxException

from agentenv.runtime.oci import files_quota_mb, writable_mb
from agentenv.testing import Node

MEMORY_MB, DISK_MB = 512, 1024  # the node's defaults (the base template names none)
FAST = 5.0  # seconds within which a call to a dead sandbox must fail


def _cgroup(node: Node, sandbox_id: str) -> Path:
    return Path(f"/sys/fs/cgroup/memory/{node.prefix}/{sandbox_id}")


def _sentry_pid(node: Node, sandbox_id: str) -> int:
    out = subprocess.run(["runsc", f"--root={node.home / 'run' / 'runsc'}", "state",
                          sandbox_id], capture_output=True, text=True, check=True).stdout
    import json

    return int(json.loads(out)["pid"])


def _state(api: httpx.Client, sandbox_id: str) -> dict:
    """The sandbox as a client sees it: GET while it can be used; once its runtime died,
    GET is E2B's 404 naming the reason, and the record is listed under state=error."""
    r = api.get(f"/sandboxes/{sandbox_id}")
    if r.status_code == 200:
        return {**r.json(), "error": None}
    assert r.status_code == 404 and "is not running" in r.json()["message"], r.text
    listed = api.get("/v2/sandboxes", params={"state": "error"})
    assert listed.status_code == 200, listed.text
    found = [s for s in listed.json() if s["sandboxID"] == sandbox_id]
    assert len(found) == 1, listed.json()
    assert found[0]["state"] == "error" and found[0]["error"] in r.json()["message"]
    # Default listings (what the e2b SDKs parse) never show it.
    assert sandbox_id not in {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    return found[0]


def _wait_error(api: httpx.Client, sandbox_id: str, within: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    while True:
        info = _state(api, sandbox_id)
        if info["state"] == "error" or time.monotonic() - t0 > within:
            return info, time.monotonic() - t0
        time.sleep(0.05)


def _assert_fails_fast(node: Node, api: httpx.Client, sbx: Sandbox, why: str) -> None:
    """Calls to a dead sandbox fail at once, naming why: the proxy to envd (a 502 JSON),
    the SDK, and API calls that need it running (409)."""
    sid = sbx.sandbox_id
    t0 = time.monotonic()
    r = httpx.get(node.url + "/health", headers={"E2b-Sandbox-Id": sid,
                                                 "E2b-Sandbox-Port": "49983"}, timeout=30)
    assert r.status_code == 502 and "not running" in r.json()["message"], r.text
    assert why in r.json()["message"], r.text
    with pytest.raises(Exception) as caught:
        sbx.commands.run("echo hi", timeout=30, request_timeout=30)
    assert "not running" in str(caught.value), caught.value
    r = api.post(f"/sandboxes/{sid}/pause")
    assert r.status_code == 409 and why in r.json()["message"], r.text
    assert time.monotonic() - t0 < 3 * FAST, "calls to a dead sandbox were slow to fail"


def _assert_removed_cleanly(node: Node, api: httpx.Client, sandbox_id: str) -> None:
    assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    assert api.get(f"/sandboxes/{sandbox_id}").status_code == 404
    assert not (node.home / "run" / "sandboxes" / sandbox_id).exists()
    assert not _cgroup(node, sandbox_id).exists()
    out = subprocess.run(["runsc", f"--root={node.home / 'run' / 'runsc'}", "list", "-quiet"],
                         capture_output=True, text=True).stdout
    assert sandbox_id not in out.split()


def _node_serves(api: httpx.Client) -> None:
    assert api.get("/health").status_code == 200
    extra = Sandbox.create("base", timeout=120)
    try:
        assert extra.commands.run("echo ok", timeout=30).stdout.strip() == "ok"
    finally:
        extra.kill()


def test_sandbox_whose_runtime_dies_is_error_at_once(node: Node, api: httpx.Client) -> None:
    """The sentry ends without the node asking (here: SIGKILL from the host): the
    sandbox is `error` within a second, with the reason; a command in flight and
    every later call fail fast; a delete removes it and everything it held. A
    snapshot (the sandbox stopped only for its capture) is not such an end."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    assert api.post(f"/sandboxes/{sid}/snapshots", json={}).status_code == 201
    r = api.post(f"/sandboxes/{sid}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    for child in r.json():
        assert "sandbox" in child, child
        api.delete(f"/sandboxes/{child['sandbox']['sandboxID']}")
    # A pause stops the runtime on purpose; the resumed one is watched anew.
    assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 300}).status_code == 201
    time.sleep(0.5)
    assert _state(api, sid)["state"] == "running"
    assert _state(api, sid)["error"] is None
    assert sbx.commands.run("echo alive").stdout.strip() == "alive"

    handle = sbx.commands.run("sleep 120", background=True, timeout=0)
    os.kill(_sentry_pid(node, sid), signal.SIGKILL)
    t0 = time.monotonic()
    info, took = _wait_error(api, sid, within=FAST)
    assert info["state"] == "error", info
    assert took < FAST, f"state error after {took:.1f} s"
    assert info["error"].startswith("exited: its runtime process ended"), info
    with pytest.raises(Exception) as in_flight:
        handle.wait()
    print(f"command in flight: {in_flight.value!r}"[:300])
    assert time.monotonic() - t0 < FAST + 2, "the command in flight hung"
    _assert_fails_fast(node, api, sbx, "exited")
    assert f"sandbox {sid} exited" in node.log_tail(200)
    # Not listed as running; the record holds no slot, runtime or cgroup any more.
    assert sid not in [s["sandboxID"] for s in api.get("/sandboxes").json()]
    assert not _cgroup(node, sid).exists()
    _assert_removed_cleanly(node, api, sid)


def test_host_oom_kill_is_reported_with_its_reason(node: Node, api: httpx.Client) -> None:
    """When the host's OOM killer takes the whole sandbox anyway (a host where the
    node cannot turn it off for the sandbox's cgroup), its state says so at once:
    "was killed: out of memory: the sandbox used X MB of its Y MB limit"."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    cg = _cgroup(node, sid)
    (cg / "memory.oom_control").write_text("0")
    # Leave the sandbox less room on the host than its guest thinks it has, so that
    # the host kills before anything inside notices.
    usage = int((cg / "memory.usage_in_bytes").read_text())
    (cg / "memory.limit_in_bytes").write_text(str(usage + (48 << 20)))
    sbx.commands.run("python3 -c 'x = bytearray(200 << 20); import time; time.sleep(60)'",
                     background=True, timeout=0)
    info, took = _wait_error(api, sid, within=30)
    assert info["state"] == "error", info
    assert info["error"].startswith("was killed: out of memory: the sandbox used"), info
    print(f"host OOM kill reported in {took:.1f} s: {info['error']}")
    log = node.log_tail(400)
    assert f"sandbox {sid} was killed: out of memory: the sandbox used" in log, log
    _assert_fails_fast(node, api, sbx, "out of memory")
    _assert_removed_cleanly(node, api, sid)


# envd (the sandbox's pid 1) stopped, so its guard cannot act before the host limit,
# as when a loaded host delays it; the command's own shell resumes it after a while.
# The hog starts once envd is stopped (a file says so).
STOP_ENVD = ("(kill -STOP 1; touch /tmp/envd-stopped; sleep RESUME; kill -CONT 1) & "
             "until [ -e /tmp/envd-stopped ]; do sleep 0.05; done; ")


def test_a_sandbox_at_its_limit_is_held_while_envd_frees_memory(
        node: Node, api: httpx.Client) -> None:
    """A hog reaches the host cgroup's limit before envd's guard acts (here: envd is
    stopped meanwhile). The sandbox is held at its limit, not killed whole; once envd
    runs it kills the hog, the sandbox lives, and its limit is its own again."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    cg = _cgroup(node, sid)
    own_limit = int((cg / "memory.limit_in_bytes").read_text())
    try:
        # envd comes back after 7 s: the hog must reach the limit before (a loaded run's
        # took more than 4 s, and envd's guard killed it short of the limit, nothing held),
        # and the hold must not outlast the node's patience (OomHold.GIVE_UP_S, 10 s).
        # (Nothing inside can wait on the hold itself: a held sandbox forks nothing; `sleep`
        # runs already and `kill` is bash's own.)
        with pytest.raises(CommandExitException) as hog:
            sbx.commands.run(STOP_ENVD.replace("RESUME", "7") + "python3 -c 'import time; b = "
                             "[bytearray(50 << 20) for _ in range(12)]; time.sleep(30)'; exit $?",
                             user="root", timeout=90, request_timeout=90)
        assert hog.value.exit_code == 137, hog.value
        assert f"sandbox {sid} reached its {own_limit >> 20} MB host memory limit; held " \
            "there" in node.log_tail(400)
        assert sbx.commands.run("echo alive", timeout=30).stdout.strip() == "alive"
        assert _state(api, sid)["state"] == "running"
        deadline = time.monotonic() + 10
        while int((cg / "memory.limit_in_bytes").read_text()) != own_limit:
            assert time.monotonic() < deadline, "the lift was not taken back"
            time.sleep(0.2)
    finally:
        api.delete(f"/sandboxes/{sid}")
    _node_serves(api)


def test_a_sandbox_envd_cannot_free_is_ended_with_its_reason(
        node: Node, api: httpx.Client) -> None:
    """Held at its limit and envd never frees memory (stopped for good here): the node
    ends the sandbox after a while, as the host's OOM killer would have, and says so."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    # In the foreground: with envd stopped, a background command's start would not be
    # answered either. The call ends when the sandbox does.
    with pytest.raises(SandboxException) as ended:
        sbx.commands.run(STOP_ENVD.replace("RESUME", "600") + "python3 -c 'import time; b = "
                         "[bytearray(64 << 20) for _ in range(16)]; time.sleep(60)'",
                         user="root", timeout=90, request_timeout=90)
    print(f"the command's call ended with: {ended.value!r}")
    info, took = _wait_error(api, sid, within=FAST)
    assert info["state"] == "error", info
    assert info["error"].startswith("was killed: out of memory: the sandbox reached its "), info
    # Ended by the node once it gave up, or (seen in CI under load) by gVisor's kernel
    # itself while held, when an allocation it could not wait for failed at the limit.
    assert info["error"].endswith(("envd could not free memory; the node ended it",
                                   "and its runtime ended there")), info
    print(f"in state error {took:.1f} s after the call ended: {info['error']}")
    _assert_fails_fast(node, api, sbx, "out of memory")
    _assert_removed_cleanly(node, api, sid)
    _node_serves(api)


@pytest.mark.parametrize("where", ["/tmp", "/home/user"])
def test_files_each_under_the_file_limit_but_past_memory(node: Node, api: httpx.Client,
                                                          where: str) -> None:
    """Issue 12 (6a): four parallel dd of 256 MB (each under RLIMIT_FSIZE, 384 MB) in a
    512 MB sandbox. /tmp: ENOSPC at its size; the root layer: envd's guard stops the
    writers once / and /tmp together pass the quota. The sandbox lives, the files can
    be deleted; the node serves on."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        t0 = time.monotonic()
        try:
            r = sbx.commands.run(
                f"for i in 1 2 3 4; do dd if=/dev/zero of={where}/f$i bs=1M count=256 "
                f"2>>/home/user/dd.err & done; wait; cat /home/user/dd.err; "
                f"du -cm {where}/f* | tail -1", timeout=90, request_timeout=90)
        except Exception as exc:
            # The root layer's guard polls (runsc has no size bound for it): should the
            # writers outrun it to the host's limit mid-command (seen about 1 run in 10),
            # the sandbox must be reported at once, with the reason. /tmp never may.
            assert where != "/tmp", exc
            info, took = _wait_error(api, sid, within=FAST)
            assert info["state"] == "error" and "out of memory" in info["error"], (exc, info)
            _assert_fails_fast(node, api, sbx, "out of memory")
            return
        took = time.monotonic() - t0
        total = int(r.stdout.split()[-2])
        print(f"{where}: 4 x 256 MB -> {total} MB kept in {took:.1f} s; {r.stdout!r}")
        if where == "/tmp":
            assert "No space left on device" in r.stdout, r.stdout
            assert total <= writable_mb(DISK_MB, MEMORY_MB), r.stdout
        else:
            # Killed by envd's guard (no "records out" for the killed ones), past the
            # quota by what the writers wrote between two looks.
            print(f"quota {files_quota_mb(DISK_MB, MEMORY_MB)} MB, overshoot "
                  f"{total - files_quota_mb(DISK_MB, MEMORY_MB)} MB")
            assert total < 4 * 256, "the writers were not stopped"
            if _state(api, sid)["state"] == "error":
                # The guard polls: should its overshoot reach the host's limit, the
                # sandbox is reported with the reason at once (seen in no run yet).
                assert "out of memory" in node.log_tail(200)
                _assert_fails_fast(node, api, sbx, "out of memory")
                return
        assert _state(api, sid)["state"] == "running"
        assert sbx.commands.run("echo alive", timeout=30).stdout.strip() == "alive"
        r = sbx.commands.run(f"rm {where}/f*; echo x > {where}/small; cat {where}/small",
                             timeout=30)
        assert r.stdout.strip() == "x"
    finally:
        api.delete(f"/sandboxes/{sid}")
    _node_serves(api)


SOCKETS = """
import socket, time

srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4096)
keep = []
for i in range(PAIRS):
    c = socket.create_connection(srv.getsockname()); s, _ = srv.accept(); keep += [c, s]
open("/home/user/sockets.ok", "w").write(str(len(keep)))
time.sleep(600)
"""
HOG = ("python3 -c 'import time\nx = []\nfor i in range(MB // 32): "
       "x.append(bytearray(32 << 20))\ntime.sleep(600)'")


def test_sockets_then_a_workload(node: Node, api: httpx.Client) -> None:
    """Issue 12 (6b): many loopback sockets grow gVisor's sentry (host memory the
    guest's `free` does not show), then an ordinary workload that fits what the guest
    sees pushes the cgroup to its limit. The node tells envd, which kills the process
    with the largest footprint: the sandbox lives. (Should the host kill it anyway,
    it must be `error` at once, with the reason.)"""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    cg = _cgroup(node, sid)
    try:
        sbx.files.write("/home/user/sockets.py", SOCKETS.replace("PAIRS", "15000"))
        sbx.commands.run("ulimit -n 65536; python3 /home/user/sockets.py", background=True,
                         timeout=0)
        r = sbx.commands.run("for i in $(seq 600); do [ -s /home/user/sockets.ok ] && break; "
                             "sleep 0.1; done; cat /home/user/sockets.ok; echo; free -m | "
                             "awk '/Mem:/ {print $3}'", timeout=90)
        assert len(r.stdout.split()) == 2, (r.stdout, r.stderr)
        held, guest_used = r.stdout.split()
        host_mb = int((cg / "memory.usage_in_bytes").read_text()) >> 20
        print(f"{held} sockets: host cgroup {host_mb} MB, guest `free` used {guest_used} MB")
        # The next workload: within what the guest sees as free.
        sbx.commands.run(HOG.replace("MB", str(MEMORY_MB - 128)), background=True, timeout=0)
        deadline = time.monotonic() + 30
        state, killed = "running", False
        while time.monotonic() < deadline and not killed:
            state = _state(api, sid)["state"]
            if state == "error":
                break
            try:
                r = sbx.commands.run("pgrep -f [s]ockets.py >/dev/null; a=$?; pgrep -f "
                                     "[b]ytearray >/dev/null; echo $a $?", timeout=30,
                                     request_timeout=30)
            except Exception:  # the host killed it as this ran: its state tells next round
                continue
            if r.stdout.split() != ["0", "0"] and (
                    int((cg / "memory.usage_in_bytes").read_text()) <
                    int((cg / "memory.limit_in_bytes").read_text())):
                killed = True  # a hog is gone
            time.sleep(0.2)
        log = node.log_tail(400)
        print(f"after the workload: {state}; host cgroup "
              f"{int((cg / 'memory.max_usage_in_bytes').read_text()) >> 20} MB at most")
        if state == "error":
            assert f"sandbox {sid} was killed: out of memory" in log, log
            _assert_fails_fast(node, api, sbx, "out of memory")
        else:
            assert killed, "neither hog was killed"
            assert f"sandbox {sid}: " in log and "telling envd to free memory" in log, log
            assert sbx.commands.run("echo alive", timeout=30).stdout.strip() == "alive"
            assert _state(api, sid)["state"] == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")
    _node_serves(api)
