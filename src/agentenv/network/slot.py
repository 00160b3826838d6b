"""One network slot: the netns pair, veths, addresses, routes and router rules.

Every function here is blocking (netlink + one iptables-restore) and may enter
network namespaces; call them through :func:`nsutil.run_in_thread`.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
from collections import Counter
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.conntrack import Conntrack
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import TCP_CONNTRACK_ESTABLISHED, NFCTAttrTuple

from . import nsutil
from .policy import CompiledPolicy, chain_rules
from .rules import (
    EGRESS_CHAIN,
    EGRESS_CT_MARK,
    GATEWAY_IP,
    INSIDE_PREFIXLEN,
    ROUTER_DOWN_IF,
    ROUTER_UP_IF,
    SANDBOX_IF,
    SANDBOX_IP,
    router_rules,
)

IFNAMSIZ = 15  # usable characters of an interface name
# Like the inside addresses, the inside link-layer addresses are the same in
# every slot: a restored sandbox keeps its own MAC and its neighbour cache (the
# gateway's MAC) from the checkpoint, so both must hold in whatever slot it lands.
SANDBOX_MAC = "02:ae:a9:fe:00:15"
GATEWAY_MAC = "02:ae:a9:fe:00:16"
# Policy routing in the router netns carries the internet switch: packets from
# the sandbox to the host (replies to connections the host opened) are routed
# normally; with internet off, everything else arriving on dn0 is blackholed.
RULE_TO_HOST_PRIO = 100
RULE_BLACKHOLE_PRIO = 200
MAIN_TABLE = 254
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]*$")


class SlotError(RuntimeError):
    """A slot could not be created, reset or destroyed."""


@dataclass
class Slot:
    """A prepared network position for one sandbox.

    ``address`` is what the host connects to; inside, the sandbox always sees
    ``eth0`` 169.254.0.21/30 with its gateway at 169.254.0.22.
    """

    index: int
    address: str
    host_ip: str
    netns: str
    netns_path: str
    router_netns: str
    host_link: str
    internet: bool = True


class SlotLayout:
    """Names and addresses of a pool's slots (no system state)."""

    def __init__(self, prefix: str, pool_cidr: str) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"network prefix {prefix!r}: use lowercase letters and digits")
        net = ipaddress.IPv4Network(pool_cidr)
        self.prefix = prefix
        self.pool_cidr = str(net)
        self._net = net
        self.max_index = net.num_addresses // 4 - 1
        if self.max_index < 1:
            raise ValueError(f"pool {pool_cidr} is too small for a /30 slot")
        longest = len(self.host_link(self.max_index))
        if longest > IFNAMSIZ:
            raise ValueError(
                f"prefix {prefix!r} with pool {pool_cidr} gives interface names of "
                f"{longest} characters (limit {IFNAMSIZ})"
            )
        self._link_re = re.compile(rf"^{re.escape(prefix)}h(\d+)$")
        self._ns_re = re.compile(rf"^{re.escape(prefix)}-([sr])(\d+)$")

    def host_link(self, index: int) -> str:
        return f"{self.prefix}h{index}"

    def sandbox_netns(self, index: int) -> str:
        return f"{self.prefix}-s{index}"

    def router_netns(self, index: int) -> str:
        return f"{self.prefix}-r{index}"

    def slot(self, index: int, internet: bool = True) -> Slot:
        if not 1 <= index <= self.max_index:
            raise ValueError(f"slot index {index} outside 1..{self.max_index}")
        base = self._net.network_address + 4 * index
        ns = self.sandbox_netns(index)
        return Slot(
            index=index,
            address=str(base + 2),
            host_ip=str(base + 1),
            netns=ns,
            netns_path=nsutil.netns_path(ns),
            router_netns=self.router_netns(index),
            host_link=self.host_link(index),
            internet=internet,
        )

    def link_index(self, ifname: str) -> int | None:
        m = self._link_re.match(ifname)
        return int(m.group(1)) if m else None

    def netns_index(self, name: str) -> int | None:
        m = self._ns_re.match(name)
        return int(m.group(2)) if m else None


# --- netlink helpers -------------------------------------------------------


def _ifindex(ipr: IPRoute, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def _up(ipr: IPRoute, name: str, address: str | None = None) -> None:
    idx = _ifindex(ipr, name)
    if idx is None:
        raise SlotError(f"interface {name} missing")
    if address:
        ipr.addr("add", index=idx, address=address, prefixlen=INSIDE_PREFIXLEN)
    ipr.link("set", index=idx, state="up")


def _isolate_sysctls(router: bool) -> None:
    """Sysctls of a fresh netns (calling thread inside it)."""
    nsutil.write_sysctl("net.ipv6.conf.all.disable_ipv6", "1")
    nsutil.write_sysctl("net.ipv6.conf.default.disable_ipv6", "1")
    if router:
        nsutil.write_sysctl("net.ipv4.ip_forward", "1")


def _set_blackhole(ipr_router: IPRoute, on: bool) -> None:
    """Internet off = blackhole rule present (idempotent both ways)."""
    spec = {
        "priority": RULE_BLACKHOLE_PRIO,
        "iifname": ROUTER_DOWN_IF,
        "action": "FR_ACT_BLACKHOLE",
    }
    try:
        ipr_router.rule("add" if on else "del", **spec)
    except NetlinkError as exc:
        if exc.code not in (errno.EEXIST, errno.ENOENT):
            raise


def _make_sandbox_side(slot: Slot, ipr_router: IPRoute) -> None:
    """Create the sandbox netns and the dn0/eth0 veth, configured; router socket given."""
    with nsutil.created(slot.netns):
        _isolate_sysctls(router=False)
        ipr_sb = IPRoute()
    try:
        fd = os.open(slot.netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            ipr_router.link(
                "add",
                ifname=ROUTER_DOWN_IF,
                address=GATEWAY_MAC,
                kind="veth",
                peer={"ifname": SANDBOX_IF, "net_ns_fd": fd, "address": SANDBOX_MAC},
            )
        finally:
            os.close(fd)
        _up(ipr_sb, "lo")
        _up(ipr_sb, SANDBOX_IF, SANDBOX_IP)
        ipr_sb.route("add", dst="0.0.0.0/0", gateway=GATEWAY_IP)
        _up(ipr_router, ROUTER_DOWN_IF, GATEWAY_IP)
    finally:
        ipr_sb.close()


# --- slot lifecycle --------------------------------------------------------


def slot_exists_partly(slot: Slot) -> bool:
    if os.path.lexists(slot.netns_path) or os.path.lexists(nsutil.netns_path(slot.router_netns)):
        return True
    with IPRoute() as ipr:
        return _ifindex(ipr, slot.host_link) is not None


def create_slot(slot: Slot, pool_cidr: str, private: list[str] | None = None) -> None:
    """Build every piece of ``slot`` from scratch (removing leftovers of a crash first);
    ``private``: the router's AENV-PRIVATE chain (``policy.private_rules``)."""
    if slot_exists_partly(slot):
        destroy_slot(slot)
    try:
        with nsutil.created(slot.router_netns):
            _isolate_sysctls(router=True)
            nsutil.iptables_restore(router_rules(slot.address, pool_cidr, private=private),
                                    noflush=False)
            ipr_router = IPRoute()
        try:
            with IPRoute() as ipr:
                fd = os.open(nsutil.netns_path(slot.router_netns), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    ipr.link(
                        "add",
                        ifname=slot.host_link,
                        kind="veth",
                        peer={"ifname": ROUTER_UP_IF, "net_ns_fd": fd},
                    )
                finally:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    nsutil.write_sysctl(f"net.ipv6.conf.{slot.host_link}.disable_ipv6", "1")
                hidx = _ifindex(ipr, slot.host_link)
                ipr.addr("add", index=hidx, address=slot.host_ip, prefixlen=30)
                ipr.link("set", index=hidx, state="up")
            _up(ipr_router, "lo")
            _up(ipr_router, ROUTER_UP_IF, slot.address)
            ipr_router.route("add", dst="0.0.0.0/0", gateway=slot.host_ip)
            ipr_router.rule(
                "add",
                priority=RULE_TO_HOST_PRIO,
                iifname=ROUTER_DOWN_IF,
                dst=slot.host_ip,
                dst_len=32,
                table=MAIN_TABLE,
            )
            _set_blackhole(ipr_router, not slot.internet)
            _make_sandbox_side(slot, ipr_router)
        finally:
            ipr_router.close()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            destroy_slot(slot)
        if isinstance(exc, (OSError, NetlinkError, RuntimeError)):
            raise SlotError(f"creating slot {slot.index}: {exc}") from exc
        raise


def destroy_slot(slot: Slot) -> None:
    """Remove every piece of ``slot``; tolerant of pieces already gone."""
    with IPRoute() as ipr:
        idx = _ifindex(ipr, slot.host_link)
        if idx is not None:
            with contextlib.suppress(NetlinkError):
                ipr.link("del", index=idx)
    nsutil.remove(slot.router_netns)
    nsutil.remove(slot.netns)
    forget_host_conntrack(slot.address)


def set_egress(slot: Slot, allowed: bool) -> None:
    """Flip the internet switch: one netlink message in the router netns.

    Off blocks every packet the sandbox sends except to the host's uplink
    address, so connections already open to the outside stop too; connections
    the host opened to the sandbox are unaffected.
    """
    with nsutil.entered(slot.router_netns), IPRoute() as ipr:
        _set_blackhole(ipr, not allowed)


def apply_policy(slot: Slot, pool_cidr: str, compiled: CompiledPolicy | None,
                 private: list[str] | None = None) -> None:
    """Put an egress policy in force in the slot's router (None: everything goes out).

    One flushing iptables-restore of the router's whole rule set (atomic, and it
    also upgrades a router built before the egress chain existed) plus the
    blackhole switch. Rules match every packet the sandbox sends, not only new
    connections, so open connections to a newly refused address stop too.
    """
    blackhole = compiled.blocks_everything if compiled is not None else not slot.internet
    with nsutil.entered(slot.router_netns):
        nsutil.iptables_restore(router_rules(slot.address, pool_cidr, chain_rules(compiled),
                                             private), noflush=False)
        with IPRoute() as ipr:
            _set_blackhole(ipr, blackhole)
    slot.internet = not blackhole


def reset_slot(slot: Slot, internet: bool) -> None:
    """Give ``slot`` a fresh sandbox side and policy, keeping router netns and uplink.

    The old sandbox netns is unbound and its veth deleted (which also cuts off
    any process still inside it), the router's conntrack table is flushed, the
    egress switch set to ``internet``, and host conntrack entries of the slot
    address are deleted: nothing of the previous sandbox remains reachable.
    """
    with nsutil.entered(slot.router_netns):
        ipr_router = IPRoute()
        try:
            idx = _ifindex(ipr_router, ROUTER_DOWN_IF)
            if idx is not None:
                ipr_router.link("del", index=idx)
            _set_blackhole(ipr_router, not internet)
            # The previous sandbox's egress policy goes with it.
            nsutil.iptables_restore(f"*filter\n:{EGRESS_CHAIN} - [0:0]\nCOMMIT\n")
            with Conntrack() as ct:
                ct.flush()
        except BaseException:
            ipr_router.close()
            raise
    try:
        nsutil.remove(slot.netns)
        _make_sandbox_side(slot, ipr_router)
    finally:
        ipr_router.close()
    forget_host_conntrack(slot.address)
    slot.internet = internet


def readdress_sandbox_side(slot: Slot) -> None:
    """Ready a held slot whose sandbox has just been destroyed for the next sandbox of
    the same holder (a reset), keeping everything else: router, uplink, egress policy.

    gVisor takes ``eth0``'s address and routes away from the host's view when it
    starts, and runsc restores networking only into a netns with the addresses of
    the checkpoint: they are put back. The router's conntrack is flushed, as the
    connections it tracked belonged to processes that are gone.
    """
    with nsutil.entered(slot.netns), IPRoute() as ipr:
        idx = _ifindex(ipr, SANDBOX_IF)
        if idx is None:
            raise SlotError(f"slot {slot.index}: interface {SANDBOX_IF} missing")
        if not ipr.get_addr(index=idx, address=SANDBOX_IP):
            ipr.addr("add", index=idx, address=SANDBOX_IP, prefixlen=INSIDE_PREFIXLEN)
        ipr.link("set", index=idx, state="up")
        try:
            ipr.route("add", dst="0.0.0.0/0", gateway=GATEWAY_IP)
        except NetlinkError as exc:
            if exc.code != errno.EEXIST:
                raise
    with nsutil.entered(slot.router_netns), Conntrack() as ct:
        ct.flush()


def egress_by_address() -> Counter[str]:
    """Established outbound TCP connections per slot address, from one dump of the
    host's conntrack table. Every connection a sandbox opens crosses the root netns
    with its slot address as source (the router MASQUERADEs), so one dump answers
    for every sandbox at once: a pass over hundreds of sandboxes costs one walk of
    the table, not one netns entry and one walk each. The kernel returns only the
    entries the pool's rules marked (``EGRESS_CT_MARK``): the node's own loopback
    and proxied connections, thousands under load, are never decoded."""
    held: Counter[str] = Counter()
    with Conntrack() as ct:
        for entry in ct.dump_entries(mark=EGRESS_CT_MARK, mark_mask=EGRESS_CT_MARK):
            if entry.protoinfo is not None and \
                    entry.protoinfo.state == TCP_CONNTRACK_ESTABLISHED:
                held[entry.tuple_orig.saddr] += 1
    return held


def forget_host_conntrack(address: str) -> None:
    """Delete root-netns conntrack entries the slot originated (its egress).

    After the router's MASQUERADE, all of a sandbox's outbound connections have
    the slot address as original source in the host table; dropping them means
    late replies of the old sandbox's peers cannot reach the next sandbox. (A
    filtered dump walks the kernel's whole table: ~10 ms even when empty.)
    """
    try:
        with Conntrack() as ct:
            entries = list(ct.dump_entries(tuple_orig=NFCTAttrTuple(saddr=address)))
            for entry in entries:
                with contextlib.suppress(NetlinkError):
                    ct.delete(entry)
    except (NetlinkError, OSError):
        pass  # conntrack not loaded or not readable: nothing to forget
