"""Isolation, tried from inside real sandboxes (as root inside): no host files, no host
processes, no route to the node, host services, link-local metadata, other sandboxes
or the host's other interfaces (whatever the egress policy says), no raw sockets, and
a corpus of escape attempts that all fail."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node

METADATA_IP = "169.254.169.254"
DUMMY = f"xsnd{os.getpid() % 10000}"


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def host_service() -> Iterator[int]:
    """An HTTP server on every host address (0.0.0.0), plus a metadata-style address
    (169.254.169.254 on a dummy link) that the host itself can reach."""
    subprocess.run(["ip", "link", "del", DUMMY], capture_output=True)
    # (No dummy driver here: a veth pair, both ends on the host, both up.)
    subprocess.run(["ip", "link", "add", DUMMY, "type", "veth", "peer", "name", DUMMY + "p"],
                   check=True)
    subprocess.run(["ip", "addr", "add", f"{METADATA_IP}/32", "dev", DUMMY], check=True)
    subprocess.run(["ip", "link", "set", DUMMY, "up"], check=True)
    subprocess.run(["ip", "link", "set", DUMMY + "p", "up"], check=True)
    server = ThreadingHTTPServer(("0.0.0.0", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        subprocess.run(["ip", "link", "del", DUMMY], capture_output=True)


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    return sorted({ln.split()[3].split("/")[0] for ln in out.splitlines()})


def answering_host_addresses(port: int) -> list[str]:
    """The host's addresses where the test server answers from the host itself. Other
    nodes on this machine (the other pytest worker's) add and remove their slots' links
    meanwhile: an address gone between the listing and its check is left out, one still
    there must answer."""
    found = []
    for a in host_addresses():
        try:
            assert httpx.get(f"http://{a}:{port}/", timeout=5).text == "hello", a
        except (httpx.ConnectError, httpx.ConnectTimeout):
            assert a not in host_addresses(), f"{a} is the host's and refused"
            continue
        found.append(a)
    return found


def slot_addresses(prefix: str) -> list[str]:
    """The sandbox-side address of every slot of the node (host link address + 1)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for ln in out.splitlines():
        parts = ln.split()
        if parts[1].startswith(f"{prefix}h"):
            a, b, c, d = parts[3].split("/")[0].split(".")
            found.append(f"{a}.{b}.{c}.{int(d) + 1}")
    return found


PROBE = r'''
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
targets = json.loads(sys.argv[1])
out = {}

def one(target):
    host, port = target
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        out[f"{host}:{port}"] = s.recv(64).decode(errors="replace")[:12] or "connected"
    except OSError as e:
        out[f"{host}:{port}"] = None
    finally:
        s.close()

with ThreadPoolExecutor(32) as pool:
    list(pool.map(one, targets))
print(json.dumps(out))
'''


def probe(sbx: Sandbox, targets: list[tuple[str, int]]) -> dict[str, str | None]:
    sbx.files.write("/tmp/probe.py", PROBE)
    r = sbx.commands.run(f"python3 /tmp/probe.py '{json.dumps(targets)}'", timeout=120)
    return json.loads(r.stdout)


def test_no_route_to_host_node_metadata_or_other_sandboxes(
        node: Node, api: httpx.Client, host_service: int) -> None:
    port = host_service
    addrs = answering_host_addresses(port)
    # The test server answers on every one of those addresses from the host itself.
    assert httpx.get(f"http://{METADATA_IP}:{port}/", timeout=5).text == "hello"
    other = Sandbox.create("base", timeout=300)
    sbx = Sandbox.create("base", timeout=300)
    try:
        other.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True, timeout=0)
        other.commands.run("for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/8000) "
                           "2>/dev/null && exit 0; sleep 0.1; done; exit 1")
        slots = slot_addresses(node.prefix)
        # From the host, the other sandbox's server answers at its slot address.
        assert any(_host_get(s, 8000) for s in slots)
        targets = [(a, port) for a in addrs] + [(a, node.port) for a in addrs]
        targets += [(METADATA_IP, port), (METADATA_IP, 80), ("169.254.0.22", 80)]
        targets += [(s, 8000) for s in slots] + [(s, 49983) for s in slots]
        for policy in ({}, {"allowOut": [*addrs, METADATA_IP, f"{slots[0]}/8",
                                         "0.0.0.0/0"]}):
            # Not even an egress policy that allows it all opens these.
            assert api.put(f"/sandboxes/{sbx.sandbox_id}/network",
                           json=policy).status_code == 204
            got = probe(sbx, targets)
            opened = {k: v for k, v in got.items() if v is not None}
            assert not opened, f"reachable from inside with policy {policy}: {opened}"
        # Its own loopback is its own: the node's port there is closed.
        assert probe(sbx, [("127.0.0.1", node.port)]) == {f"127.0.0.1:{node.port}": None}
    finally:
        sbx.kill()
        other.kill()


def _host_get(addr: str, port: int) -> bool:
    try:
        return httpx.get(f"http://{addr}:{port}/", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def test_no_host_files_processes_or_other_sandboxes_files(node: Node) -> None:
    marker = Path(f"/tmp/xsn-host-secret-{os.getpid()}")
    secret = secrets.token_hex(16)
    marker.write_text(secret)
    a = Sandbox.create("base", timeout=300)
    b = Sandbox.create("base", timeout=300)
    try:
        a.files.write("/home/user/mine.txt", secret)
        checks = {
            "host marker": f"cat {marker}",
            "node home": f"ls {node.home}",
            "node api key": f"cat {node.home}/secrets/api-key",
            "other sandbox's file": "cat /home/user/mine.txt",
            "host root by /proc/1/root": f"cat /proc/1/root{marker}",
        }
        for name, cmd in checks.items():
            r = b.commands.run(f"{cmd} 2>&1; echo rc=$?", user="root")
            assert secret not in r.stdout and node.api_key not in r.stdout, name
            assert not r.stdout.strip().endswith("rc=0"), (name, r.stdout)
        # Processes: only the sandbox's own (envd is pid 1); the host's are not there.
        ps = b.commands.run("ps -eo pid,comm --no-headers", user="root").stdout
        names = {ln.split()[1] for ln in ps.splitlines() if ln.strip()}
        assert not names & {"aenv", "runsc", "runsc-sandbox", "exe", "systemd", "sshd",
                            "python3.11"} or names <= {"python3", "bash", "ps"}, names
        assert len(ps.splitlines()) < 10, ps
        first = b.commands.run("cat /proc/1/cmdline | tr '\\0' ' '", user="root").stdout
        assert "agentenv.envd" in first
        assert b.commands.run(f"test -e /proc/{os.getpid()} && cat /proc/{os.getpid()}/cmdline"
                              " | tr '\\0' ' '; true").stdout.find("pytest") == -1
        # A kernel of its own.
        assert b.commands.run("uname -r").stdout.strip() != os.uname().release
    finally:
        a.kill()
        b.kill()
        marker.unlink()


ESCAPES = r'''
import ctypes, ctypes.util, errno, json, os, socket, subprocess
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, fn):
    try:
        res = fn()
        out[name] = "ok" if res is None or res == "ok" else f"failed: {res}"
    except Exception as e:
        out[name] = f"failed: {type(e).__name__}: {e}"[:120]

def sh(cmd):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return "ok" if r.returncode == 0 else f"rc {r.returncode} {r.stderr.strip()[-80:]}"

def sys_rc(rc):
    return "ok" if rc == 0 else f"errno {os.strerror(ctypes.get_errno())}"

attempt("raw socket",
        lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close())
attempt("packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close())
attempt("mount tmpfs", lambda: sh("mkdir -p /mnt/x && mount -t tmpfs none /mnt/x"))
attempt("mount proc", lambda: sh("mkdir -p /mnt/p && mount -t proc proc /mnt/p"))
attempt("remount / rw bind", lambda: sys_rc(libc.mount(b"/", b"/mnt", None, 4096 | 16384, None)))
attempt("ptrace attach envd", lambda: sys_rc(libc.ptrace(16, 1, None, None)))
attempt("process_vm_readv envd", lambda: sh("cat /proc/1/mem > /dev/null"))
attempt("init_module", lambda: sys_rc(libc.syscall(175, None, 0, b"")))
attempt("finit_module", lambda: sys_rc(libc.syscall(313, 0, b"", 0)))
attempt("kexec_load", lambda: sys_rc(libc.syscall(246, 0, 0, None, 0)))
attempt("mknod block dev and read",
        lambda: sh("mknod /tmp/sda b 8 0 && head -c 1 /tmp/sda > /dev/null"))
attempt("mknod /dev/mem and read",
        lambda: sh("mknod /tmp/mem c 1 1 && head -c 1 /tmp/mem > /dev/null"))
attempt("host disk /dev/vda", lambda: sh("head -c 1 /dev/vda > /dev/null"))
attempt("write /proc/sys/kernel/core_pattern",
        lambda: sh("echo '|/bin/sh' > /proc/sys/kernel/core_pattern"))
attempt("write /proc/sysrq-trigger", lambda: sh("echo c > /proc/sysrq-trigger"))
attempt("write /proc/sys/vm/drop_caches", lambda: sh("echo 3 > /proc/sys/vm/drop_caches"))
attempt("write /sys", lambda: sh("echo 1 > /sys/kernel/mm/ksm/run"))
attempt("create under /sys", lambda: sh("touch /sys/xsn-test"))
attempt("setns into host netns via /proc/1/ns",
        lambda: sh("nsenter -t 1 -n ip link add x type dummy"))
attempt("iptables in sandbox", lambda: sh("iptables -L 2>/dev/null"))
attempt("bpf syscall", lambda: sys_rc(libc.syscall(321, 0, None, 0)))
attempt("perf_event_open", lambda: sys_rc(libc.syscall(298, None, 0, -1, -1, 0)))
attempt("open_by_handle_at", lambda: sys_rc(libc.syscall(304, 0, None, 0)))
attempt("keyctl", lambda: sys_rc(libc.syscall(250, 0, 0, 0, 0, 0)))
attempt("settimeofday", lambda: sh("date -s '2001-01-01'"))
attempt("chroot break-out", lambda: sh("mkdir -p /tmp/c && chroot /tmp/c /bin/true"))
attempt("read envd memory as user",
        lambda: sh("su -s /bin/sh user -c 'head -c 1 /proc/1/mem' > /dev/null"))
attempt("signal envd as user", lambda: sh("su -s /bin/sh user -c 'kill -STOP 1'"))
print(json.dumps(out))
'''


def test_escape_corpus_fails(node: Node) -> None:
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write("/tmp/escapes.py", ESCAPES)
        r = sbx.commands.run("python3 /tmp/escapes.py", user="root", timeout=120)
        results = json.loads(r.stdout)
        succeeded = {k: v for k, v in results.items() if v == "ok"}
        assert len(results) >= 25
        assert not succeeded, f"escape attempts that worked: {succeeded}"
        # The sandbox (and envd) survived the attempts.
        assert sbx.commands.run("echo alive").stdout.strip() == "alive"
        # envd's access token is in nothing a user inside can read (gVisor shows
        # /proc/1/environ to all; the token never was in it).
        token = sbx._envd_access_token
        assert token
        # (`ls -la` exits 1 when one of envd's fds closes between its listing and its
        # lstat: envd serves this very command meanwhile. What was read is the point.)
        seen = sbx.commands.run("cat /proc/1/environ /proc/1/cmdline /proc/self/environ; "
                                "env; ls -la /proc/1/fd 2>&1; true", user="user").stdout
        assert "HOME=/home/user" in seen, seen[-2000:]
        assert token not in seen
    finally:
        sbx.kill()
    # The host is untouched: no new link named by the attempt, its /sys untouched.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert " x:" not in links and not Path("/sys/xsn-test").exists()
    assert socket.gethostname()  # host still answers basic calls
