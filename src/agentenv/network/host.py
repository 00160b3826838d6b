"""What a node's slot pool finds and sets on the host itself: its root-netns rules,
slots (or pieces of them) a crash left behind, addresses of others inside its CIDR,
and the removal of everything of one prefix."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading

from pyroute2 import IPRoute

from . import nsutil
from .rules import HostChains
from .slot import SlotLayout


def install_host_rules(prefix: str, pool_cidr: str) -> None:
    """Idempotently install the pool's root-netns rules and enable forwarding."""
    chains = HostChains(prefix, pool_cidr)
    nsutil.iptables_restore(chains.install(nsutil.iptables_save()))
    nsutil.write_sysctl("net.ipv4.ip_forward", "1")


def remove_host_rules(prefix: str) -> None:
    text = HostChains(prefix).remove(nsutil.iptables_save())
    if text:
        nsutil.iptables_restore(text)


def leftovers(layout: SlotLayout) -> set[int]:
    """Indices of slots (or pieces of them) that exist on the machine."""
    found = {i for i in (layout.netns_index(n) for n in nsutil.list_netns()) if i is not None}
    with IPRoute() as ipr:
        for link in ipr.get_links():
            i = layout.link_index(link.get_attr("IFLA_IFNAME") or "")
            if i is not None:
                found.add(i)
    return found


def others_in_cidr(layout: SlotLayout) -> list[str]:
    """Host addresses inside the pool's CIDR that are not on this pool's own links:
    another node's pool (or a host network) there would see this pool's routes and
    connections as its own, and the other way round."""
    net = ipaddress.IPv4Network(layout.pool_cidr)
    found = []
    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") or "" for link in ipr.get_links()}
        for addr in ipr.get_addr(family=socket.AF_INET):
            name = names.get(addr["index"], "")
            address = addr.get_attr("IFA_ADDRESS")
            if address and ipaddress.IPv4Address(address) in net and \
                    layout.link_index(name) is None:
                found.append(f"{address} on {name or addr['index']}")
    return found


def cleanup_all(prefix: str) -> None:
    """Remove every netns, link and host rule of ``prefix`` (synchronous, idempotent).

    Safe to call from a coroutine too (it blocks that loop while it runs): the
    work runs in a thread of its own, as pyroute2's sync API needs a thread
    without a running event loop.
    """
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _cleanup_all(prefix)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=work, name="aenv-net-cleanup")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _cleanup_all(prefix: str) -> None:
    layout = SlotLayout(prefix, "10.0.0.0/29")  # names only; the CIDR is irrelevant here
    for name in nsutil.list_netns():
        if layout.netns_index(name) is not None:
            nsutil.remove(name)
    with IPRoute() as ipr:
        for link in ipr.get_links():
            if layout.link_index(link.get_attr("IFLA_IFNAME") or "") is not None:
                with contextlib.suppress(Exception):
                    ipr.link("del", index=link["index"])
    remove_host_rules(prefix)
