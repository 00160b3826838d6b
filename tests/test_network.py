"""Network slots against real netns and iptables (root needed; no mocks).

Traffic goes only to loopback and to addresses inside namespaces this file
creates: the slots, and an "outside" netns (``aetox-out``) joined to the host by
a veth, standing in for the internet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import pytest_asyncio

from agentenv.network import Slot, SlotError, SlotPool, SlotPoolExhausted, cleanup_all
from agentenv.network.slot import SlotLayout, egress_by_address

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for netns and iptables")

PREFIX = "aetest"  # main pool
PREFIX_B = "aetestb"  # small pool: recycle, exhaustion, coexistence
PREFIX_C = "aetestc"  # crash recovery
CIDR = "10.213.0.0/16"
CIDR_B = "10.216.0.0/16"
CIDR_C = "10.217.0.0/16"
OUT_NS = "aetox-out"
OUT_HOST_IF, OUT_PEER_IF = "aetoxh", "aetoxo"
OUT_HOST_IP, OUT_IP = "10.214.0.1", "10.214.0.2"
OUT_LINKLOCAL_IP = "169.254.7.1"  # a link-local address living in the outside netns
DUMMY_IP = "10.215.0.1"  # "another address of the host"
SANDBOX_IP = "169.254.0.21"

SERVER = r"""
import socket, sys
host, port, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(tag)
    finally:
        c.close()
"""

CLIENT = r"""
import json, socket, sys, threading
targets = json.loads(sys.argv[1])
out = {}
def probe(host, port):
    key = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=0.8) as c:
            c.settimeout(0.8)
            out[key] = c.recv(64).decode() or "empty"
    except OSError as exc:
        out[key] = "!" + type(exc).__name__
threads = [threading.Thread(target=probe, args=t) for t in targets]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def free_port() -> int:
    """A port number for the servers started in a slot's or the outside's namespace:
    nothing else binds there, so the number cannot be taken before they bind it (in
    the host's namespace, bind port 0 and read it back: ``host_server``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Servers started in namespaces; all killed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def serve(self, netns: str, host: str, port: int, tag: str) -> None:
        argv = [sys.executable, "-c", SERVER, host, str(port), tag]
        proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{netns}", *argv],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def loop_and_uplink(uplink: str) -> list[socket.socket]:
    """Servers on 127.0.0.1 and on the slot's uplink address at one port (port 0 for
    the first, the same for the second; another port if someone holds that one)."""
    for _ in range(20):
        loop = host_server("127.0.0.1", 0, "LOOP")
        try:
            return [loop, host_server(uplink, loop.getsockname()[1], "UPLINK")]
        except OSError:
            loop.close()
    raise AssertionError("no port free on both addresses")


def host_server(host: str, port: int, tag: str) -> socket.socket:
    """A server in the test process (root netns); closed by the caller."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind((host, port))
    except OSError:
        srv.close()
        raise
    srv.listen(64)

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(tag.encode())

    threading.Thread(target=loop, daemon=True).start()
    return srv


async def probe_from(netns: str, targets: list[tuple[str, int]]) -> dict[str, str]:
    """Connect from inside ``netns`` to every target at once; tag read or '!Error'."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter",
        f"--net=/var/run/netns/{netns}",
        sys.executable,
        "-c",
        CLIENT,
        json.dumps(targets),
        stdout=subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    return json.loads(out)


async def fetch(host: str, port: int) -> str:
    """Connect from the host (root netns)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        data = await asyncio.wait_for(reader.read(64), 1.0)
        writer.close()
        return data.decode()
    except (OSError, TimeoutError) as exc:
        return "!" + type(exc).__name__


def leftovers(prefix: str) -> list[str]:
    netns = (
        [n for n in os.listdir("/var/run/netns") if n.startswith(prefix)]
        if os.path.isdir("/var/run/netns")
        else []
    )
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in sh("ip", "-o", "link").stdout.splitlines()
    ]
    rules = [r for r in sh("iptables-save").stdout.splitlines() if prefix.upper() in r]
    return netns + [x for x in links if x.startswith(prefix)] + rules


@pytest.fixture(scope="module")
def outside() -> Iterator[None]:
    """An 'internet' netns joined to the host, plus one more host address."""
    for p in (PREFIX, PREFIX_B, PREFIX_C):
        cleanup_all(p)
    _drop_outside()
    sh("ip", "netns", "add", OUT_NS)
    sh("ip", "link", "add", OUT_HOST_IF, "type", "veth", "peer", "name", OUT_PEER_IF)
    sh("ip", "link", "set", OUT_PEER_IF, "netns", OUT_NS)
    sh("ip", "addr", "add", f"{OUT_HOST_IP}/30", "dev", OUT_HOST_IF)
    sh("ip", "link", "set", OUT_HOST_IF, "up")
    sh("ip", "route", "add", f"{OUT_LINKLOCAL_IP}/32", "dev", OUT_HOST_IF)
    sh("ip", "-n", OUT_NS, "addr", "add", f"{OUT_IP}/30", "dev", OUT_PEER_IF)
    sh("ip", "-n", OUT_NS, "addr", "add", f"{OUT_LINKLOCAL_IP}/32", "dev", OUT_PEER_IF)
    sh("ip", "-n", OUT_NS, "link", "set", OUT_PEER_IF, "up")
    sh("ip", "-n", OUT_NS, "link", "set", "lo", "up")
    sh("ip", "-n", OUT_NS, "route", "add", "default", "via", OUT_HOST_IP)
    # another address of the host, on a link of its own (no dummy module here)
    sh("ip", "addr", "add", f"{DUMMY_IP}/32", "dev", OUT_HOST_IF)
    try:
        yield
    finally:
        _drop_outside()
        for p in (PREFIX, PREFIX_B, PREFIX_C):
            cleanup_all(p)
        assert leftovers("aetest") == []
        assert leftovers("aetox") == []


def _drop_outside() -> None:
    sh("ip", "netns", "del", OUT_NS, check=False)
    sh("ip", "link", "del", OUT_HOST_IF, check=False)


@pytest.fixture(scope="module")
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pool(outside: None) -> object:
    p = SlotPool(PREFIX, CIDR, low=2, high=4, capacity=8)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
        assert leftovers(PREFIX) == [] or all(x.startswith(PREFIX_B) for x in leftovers(PREFIX))


def test_layout_names_fit_ifnamsiz() -> None:
    layout = SlotLayout("aenv", "10.11.0.0/16")
    last = layout.slot(layout.max_index)
    assert layout.max_index == 16383 and len(last.host_link) <= 15
    assert (last.address, last.host_ip) == ("10.11.255.254", "10.11.255.253")
    s3 = layout.slot(3)
    assert (s3.address, s3.host_ip, s3.netns, s3.router_netns) == (
        "10.11.0.14",
        "10.11.0.13",
        "aenv-s3",
        "aenv-r3",
    )
    assert s3.netns_path == "/var/run/netns/aenv-s3"
    with pytest.raises(ValueError):
        SlotLayout("averylongprefix", "10.11.0.0/16")
    with pytest.raises(ValueError):
        SlotLayout("Bad-Prefix", "10.11.0.0/16")


async def test_topology_inbound_and_isolation(pool: SlotPool, procs: Procs) -> None:
    await asyncio.wait_for(pool.wait_warm(2), 10)
    a = await pool.acquire(internet=True)
    b = await pool.acquire(internet=True)
    assert a.index != b.index and a.address != b.address
    for s in (a, b):
        assert isinstance(s, Slot) and os.path.exists(s.netns_path)
        inside = sh("ip", "-n", s.netns, "-4", "-o", "addr", "show", "eth0").stdout
        assert f"{SANDBOX_IP}/30" in inside
        assert "default via 169.254.0.22" in sh("ip", "-n", s.netns, "route").stdout
        assert f"{s.address}/30" in sh("ip", "-n", s.router_netns, "-o", "addr").stdout
        assert f"{s.host_ip}/30" in sh("ip", "-o", "addr", "show", s.host_link).stdout

    port = free_port()
    procs.serve(a.netns, SANDBOX_IP, port, "A")
    procs.serve(b.netns, SANDBOX_IP, port, "B")
    procs.serve(OUT_NS, "0.0.0.0", port, "OUT")
    # Inbound from the host, on every port, each slot to its own sandbox.
    assert await fetch(a.address, port) == "A"
    assert await fetch(b.address, port) == "B"

    # Host servers are bound to port 0 and their ports read back: a number chosen
    # first and bound later may be taken meanwhile by another test worker.
    servers = [host_server("0.0.0.0", 0, "HOST"), *loop_and_uplink(a.host_ip)]
    hport, lport = (srv.getsockname()[1] for srv in servers[:2])
    try:
        res = await probe_from(
            a.netns,
            [
                (OUT_IP, port),  # positive control: the internet works
                (b.address, port),  # another slot
                (SANDBOX_IP, port),  # itself, sanity
                (b.host_ip, hport),
                (a.host_ip, hport),  # host through the uplink (0.0.0.0 server)
                (a.host_ip, lport),  # server bound to the uplink address
                (DUMMY_IP, hport),  # another host address
                ("127.0.0.1", lport),  # loopback is the sandbox's own
                ("169.254.0.22", hport),  # the gateway itself offers nothing
                (OUT_LINKLOCAL_IP, port),  # link-local beyond the gateway
                (a.address, port),  # its own slot address (no hairpin)
            ],
        )
    finally:
        for srv in servers:
            srv.close()
    assert res.pop(f"{OUT_IP}:{port}") == "OUT"
    assert res.pop(f"{SANDBOX_IP}:{port}") == "A"
    assert all(v.startswith("!") for v in res.values()), res
    # and the other way round
    res = await probe_from(b.netns, [(a.address, port), (OUT_IP, port)])
    assert res == {f"{a.address}:{port}": res[f"{a.address}:{port}"], f"{OUT_IP}:{port}": "OUT"}
    assert res[f"{a.address}:{port}"].startswith("!")
    # the outside world cannot open connections to a slot either
    res = await probe_from(OUT_NS, [(a.address, port)])
    assert res[f"{a.address}:{port}"].startswith("!")
    await pool.release(a)
    await pool.release(b)


async def test_internet_switch(pool: SlotPool, procs: Procs) -> None:
    s = await pool.acquire(internet=False)
    assert s.internet is False
    port = free_port()
    procs.serve(s.netns, SANDBOX_IP, port, "S")
    procs.serve(OUT_NS, OUT_IP, port, "OUT")
    target = [(OUT_IP, port)]
    key = f"{OUT_IP}:{port}"
    assert (await probe_from(s.netns, target))[key].startswith("!")
    assert await fetch(s.address, port) == "S"  # inbound still works
    await pool.set_internet(s, True)
    assert (await probe_from(s.netns, target))[key] == "OUT"
    await pool.set_internet(s, False)
    assert (await probe_from(s.netns, target))[key].startswith("!")
    assert await fetch(s.address, port) == "S"
    t = pool.stats()["ms"]["set_internet"]
    assert t["p50"] is not None and t["p50"] < 50
    await pool.release(s)


# Connects to the address and port given and holds the connection open: an agent
# waiting on a model's answer.
HOLDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("held", flush=True)
time.sleep(60)
"""


def holding_server(host: str) -> tuple[socket.socket, list[socket.socket]]:
    """A server that accepts and keeps every connection (the caller closes all)."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return srv, held


def egress_while_held(netns: str) -> Counter[str]:
    """egress_by_address while a process in ``netns`` holds a connection to the
    outside and the host holds 50 loopback connections."""
    peer = subprocess.Popen(["ip", "netns", "exec", OUT_NS, sys.executable, "-c",
                             "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', "
                             "9009)); s.listen(); print('ready', flush=True); "
                             "c = s.accept(); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    loop_srv, loop_held = holding_server("127.0.0.1")
    clients: list[socket.socket] = []
    holder = None
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
        holder = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{netns}", sys.executable,
                                   "-c", HOLDER, OUT_IP, "9009"], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        clients = [socket.create_connection(loop_srv.getsockname()) for _ in range(50)]
        return egress_by_address()
    finally:
        for proc in (holder, peer):
            if proc is not None:
                proc.kill()
                proc.wait()
        for sock in (*clients, *loop_held, loop_srv):
            sock.close()


async def test_egress_count_is_of_slots_alone(pool: SlotPool) -> None:
    """The idle freezer's question (which sandboxes hold an outbound connection)
    is answered from the slots' own conntrack entries: the host's loopback
    connections, as many as a busy node's API and proxy hold, are not in it."""
    s = await pool.acquire(internet=True)
    try:
        held = await asyncio.to_thread(egress_while_held, s.netns)
        assert held[s.address] == 1, held
        assert "127.0.0.1" not in held, held
    finally:
        await pool.release(s)


async def test_release_recycles_clean_and_exhaustion(outside: None, procs: Procs) -> None:
    p = SlotPool(PREFIX_B, CIDR_B, low=0, high=1, capacity=1)
    await p.start()
    try:
        s = await p.acquire(internet=False)
        with pytest.raises(SlotPoolExhausted):
            await p.acquire()
        port = free_port()
        procs.serve(s.netns, SANDBOX_IP, port, "OLD")
        assert await fetch(s.address, port) == "OLD"
        old_inode = os.stat(s.netns_path).st_ino
        await p.release(s)
        # capacity 1: acquire waits for the background reset and gets the same slot
        s2 = await asyncio.wait_for(p.acquire(internet=True), 10)
        assert s2.index == s.index and s2.internet is True
        assert os.stat(s2.netns_path).st_ino != old_inode  # a fresh sandbox netns
        # the old sandbox (still running in the old netns) is cut off
        assert (await fetch(s2.address, port)).startswith("!")
        assert "blackhole" not in sh("ip", "-n", s2.router_netns, "rule").stdout
        port2 = free_port()
        procs.serve(s2.netns, SANDBOX_IP, port2, "NEW")
        procs.serve(OUT_NS, OUT_IP, port2, "OUT")
        assert await fetch(s2.address, port2) == "NEW"
        assert (await probe_from(s2.netns, [(OUT_IP, port2)]))[f"{OUT_IP}:{port2}"] == "OUT"
        st = p.stats()
        assert st["recycled"] == 1 and st["acquired"] == 1
    finally:
        await p.close()
    assert leftovers(PREFIX_B) == []


async def test_start_after_crash_removes_leftovers(outside: None) -> None:
    crashed = SlotPool(PREFIX_C, CIDR_C, low=2, high=2, capacity=4)
    await crashed.start()
    kept = await crashed.acquire(internet=False)
    lost = await crashed.acquire()
    await asyncio.wait_for(crashed.wait_warm(2), 10)
    # simulate a crash: the process forgets the pool without closing it
    assert crashed._refiller is not None
    crashed._refiller.cancel()
    del crashed
    # plus a half-created slot
    sh("ip", "netns", "add", f"{PREFIX_C}-r9")
    assert len([n for n in os.listdir("/var/run/netns") if n.startswith(PREFIX_C)]) == 9

    p = SlotPool(PREFIX_C, CIDR_C, low=1, high=2, capacity=4)
    await p.start(in_use={kept.index: False})
    try:
        names = sorted(n for n in os.listdir("/var/run/netns") if n.startswith(PREFIX_C))
        assert f"{PREFIX_C}-s{lost.index}" not in names
        assert f"{PREFIX_C}-r9" not in names
        assert {kept.netns, kept.router_netns} <= set(names)
        assert p.acquired() == {kept.index: False}
        await asyncio.wait_for(p.wait_warm(1), 10)
        fresh = await p.acquire()
        assert fresh.index != kept.index
        assert "blackhole" in sh("ip", "-n", kept.router_netns, "rule").stdout
    finally:
        await p.close()
    assert leftovers(PREFIX_C) == []


async def test_host_rules_idempotent_and_removed(outside: None) -> None:
    p = SlotPool(PREFIX_C, CIDR_C, low=0, high=0, capacity=1)
    await p.start()
    await p.close()
    await p.start()  # a second start installs nothing twice
    await p.close()
    p2 = SlotPool(PREFIX_C, CIDR_C, low=0, high=0, capacity=1)
    await p2.start()
    await p2.start()
    saved = sh("iptables-save").stdout
    assert saved.count(f"-j {PREFIX_C.upper()}-INPUT") == 1
    assert saved.count(f"-j {PREFIX_C.upper()}-FORWARD") == 1
    assert saved.count(f"-j {PREFIX_C.upper()}-POSTROUTING") == 1
    await p2.close()
    assert leftovers(PREFIX_C) == []
    cleanup_all(PREFIX_C)  # idempotent on a clean machine


async def test_a_second_pool_on_the_same_addresses_is_refused(outside: None) -> None:
    """Two nodes on one host with one net_pool_cidr would route each other's slot
    addresses and count each other's connections: the second is refused at start,
    saying why, and the first goes on serving."""
    first = SlotPool(PREFIX_B, CIDR_B, low=1, high=1, capacity=2)
    await first.start()
    try:
        await asyncio.wait_for(first.wait_warm(1), 10)
        second = SlotPool(PREFIX_C, CIDR_B, low=0, high=1, capacity=2)
        with pytest.raises(SlotError, match=f"net_pool_cidr {CIDR_B} is in use on this host"):
            await second.start()
        assert leftovers(PREFIX_C) == []
        slot = await first.acquire()
        assert ipaddress.IPv4Address(slot.address) in ipaddress.IPv4Network(CIDR_B)
    finally:
        await first.close()
    assert leftovers(PREFIX_B) == []


async def test_concurrent_acquire_respects_capacity(outside: None) -> None:
    p = SlotPool(PREFIX_B, CIDR_B, low=1, high=2, capacity=3)
    await p.start()
    try:
        results = await asyncio.gather(*(p.acquire() for _ in range(5)), return_exceptions=True)
        slots = [r for r in results if isinstance(r, Slot)]
        assert len(slots) == 3 and len({s.index for s in slots}) == 3
        assert sum(isinstance(r, SlotPoolExhausted) for r in results) == 2
        await p.release(slots[0])
        await asyncio.sleep(0.3)
        st = p.stats()
        assert st["acquired"] == 2 and st["warm"] + st["in_flight"] >= 1
        for s in slots[1:]:
            await p.release(s)
    finally:
        await p.close()
    assert leftovers(PREFIX_B) == []
    # an acquire cancelled while its slot is being built: the slot is kept warm
    p = SlotPool(PREFIX_B, CIDR_B, low=0, high=1, capacity=1)
    await p.start()
    try:
        task = asyncio.ensure_future(p.acquire())
        await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(p.wait_warm(1), 5)
        assert p.stats()["acquired"] == 0
        assert (await p.acquire()).index == 1
    finally:
        await p.close()
    assert leftovers(PREFIX_B) == []


async def test_a_burst_keeps_its_released_slots_warm(outside: None) -> None:
    """After ``expect(n)`` (a fork of n) the n slots released stay warm beyond ``high``,
    so the next burst builds none; once the hold ends the pool trims back to ``high``."""
    p = SlotPool(PREFIX_B, CIDR_B, low=0, high=1, capacity=6)
    await p.start()
    try:
        p.expect(4, hold_s=8)
        slots = await asyncio.gather(*(p.acquire() for _ in range(4)))
        for s in slots:
            await p.release(s)
        await asyncio.wait_for(p.wait_warm(4), 8)
        assert p.stats()["warm"] == 4 and p.stats()["created"] == 4
        again = await asyncio.gather(*(p.acquire() for _ in range(4)))
        assert p.stats()["created"] == 4  # the next burst reused all four
        for s in again:
            await p.release(s)
        for _ in range(200):  # the hold ends: what is warm beyond ``high`` is destroyed
            st = p.stats()
            if st["warm"] <= 1 and not st["in_flight"]:
                break
            await asyncio.sleep(0.1)
        assert p.stats()["warm"] == 1 and p.stats()["destroyed"] == 3
    finally:
        await p.close()
    assert leftovers(PREFIX_B) == []


# A host whose FORWARD policy is DROP (any host running dockerd in its root netns): a
# pool's slots still reach the outside and are reached. Run in a netns standing in for
# that host (its own FORWARD policy), never by changing this machine's.
DROP_HOST_SCRIPT = r"""
import asyncio, json, socket, subprocess, sys
from agentenv.network import SlotPool
sys.path.insert(0, sys.argv[1])
from test_network import CLIENT, SERVER, SANDBOX_IP
out_ns, cidr = sys.argv[2], sys.argv[3]
def sh(*a): subprocess.run(a, check=True, capture_output=True)
sh("iptables", "-P", "FORWARD", "DROP")
sh("ip", "link", "add", "outh", "type", "veth", "peer", "name", "outo", "netns", out_ns)
sh("ip", "addr", "add", "10.214.9.1/30", "dev", "outh"); sh("ip", "link", "set", "outh", "up")
sh("ip", "-n", out_ns, "addr", "add", "10.214.9.2/30", "dev", "outo")
sh("ip", "-n", out_ns, "link", "set", "outo", "up")
sh("ip", "-n", out_ns, "route", "add", "default", "via", "10.214.9.1")
async def main():
    pool = SlotPool("aetestf", cidr, low=0, high=1, capacity=1)
    await pool.start()
    s = await pool.acquire(internet=True)
    def serve(ns, host, tag):
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER,
                              host, "8123", tag], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        return p
    servers = [serve(out_ns, "10.214.9.2", "OUT"), serve(s.netns, SANDBOX_IP, "S")]
    probe = lambda ns, host: json.loads(subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT,
         json.dumps([[host, 8123]])], capture_output=True, text=True).stdout)
    result = {"egress": probe(s.netns, "10.214.9.2")}
    with socket.create_connection((s.address, 8123), timeout=1) as c:
        result["inbound"] = c.recv(8).decode()
    for p in servers: p.kill()
    await pool.release(s)
    await pool.close()
    result["policy"] = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True,
                                      text=True).stdout.splitlines()
    print(json.dumps(result))
asyncio.run(main())
"""


def test_slots_work_on_a_host_whose_forward_policy_is_drop() -> None:
    host, out = "aetoxf-host", "aetoxf-out"
    for ns in (host, out):
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", host, "link", "set", "lo", "up")
        r = subprocess.run(["ip", "netns", "exec", host, sys.executable, "-c", DROP_HOST_SCRIPT,
                            os.path.dirname(__file__), out, "10.218.0.0/16"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads(r.stdout.splitlines()[-1])
        assert result["egress"] == {"10.214.9.2:8123": "OUT"}  # forwarded despite DROP
        assert result["inbound"] == "S"
        # the pool's rules went with it; the host's own policy stayed DROP
        assert result["policy"] == ["-P FORWARD DROP"]
    finally:
        for ns in (host, out):
            sh("ip", "netns", "del", ns, check=False)
