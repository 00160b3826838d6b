"""iptables rule sets, as iptables-restore input.

Two places hold rules:

* the router netns of every slot (its own, complete rule set: default-drop
  INPUT and FORWARD, DNAT of the slot address to the sandbox, MASQUERADE out of
  the uplink, no new connections from the sandbox to link-local, loopback or
  pool addresses);
* the host (root netns): a few rules in chains named after the pool prefix, so
  pools with different prefixes coexist and each can be removed alone.
"""

from __future__ import annotations

import re

SANDBOX_IP = "169.254.0.21"
GATEWAY_IP = "169.254.0.22"
INSIDE_PREFIXLEN = 30
SANDBOX_IF = "eth0"
ROUTER_DOWN_IF = "dn0"
ROUTER_UP_IF = "up0"
LINK_LOCAL = "169.254.0.0/16"
LOOPBACK_NET = "127.0.0.0/8"
EGRESS_CHAIN = "AENV-EGRESS"
# A conntrack mark bit on the host's entries of the slots' outbound TCP connections
# (set by the pool's POSTROUTING chain), so that a dump asks the kernel for those
# alone: the host's table also holds every loopback and proxied connection of the
# node (thousands), which pyroute2 decodes at ~0.7 ms each.
EGRESS_CT_MARK = 0x20000000
PRIVATE_CHAIN = "AENV-PRIVATE"


def router_rules(slot_address: str, pool_cidr: str, egress: list[str] | None = None,
                 private: list[str] | None = None) -> str:
    """The complete rule set of a router netns (applied with a flushing restore).

    The all-off internet switch is not here but in policy routing (see
    ``slot.set_egress``): flipping it is one netlink message instead of an
    iptables transaction. Finer egress policy is the ``AENV-EGRESS`` chain
    (``egress``: its lines, from ``policy.chain_rules``), consulted after the
    fixed isolation drops, so no policy can open those. ``private`` (the lines of
    ``AENV-PRIVATE``, from ``policy.private_rules``) comes after it: private networks
    are refused unless the policy allowed them (its ACCEPT ends the walk first) or
    the operator opened them.
    """
    up, dn = ROUTER_UP_IF, ROUTER_DOWN_IF
    chain = "\n".join([*(egress or []), *(private or [])])
    ctdir = f"-i {dn} -o {up} -s {SANDBOX_IP}/32 -m conntrack --ctdir ORIGINAL"
    jump_private = f"-A FORWARD {ctdir} -j {PRIVATE_CHAIN}\n" if private else ""
    return f"""*filter
:INPUT DROP [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:{EGRESS_CHAIN} - [0:0]
:{PRIVATE_CHAIN} - [0:0]
{chain}
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A INPUT -i {dn} -d {GATEWAY_IP}/32 -p icmp --icmp-type echo-request -j ACCEPT
-A FORWARD -i {up} -o {dn} -d {SANDBOX_IP}/32 -m conntrack --ctstate DNAT --ctdir ORIGINAL -j ACCEPT
-A FORWARD -i {dn} -o {up} -s {SANDBOX_IP}/32 -m conntrack --ctstate DNAT --ctdir REPLY -j ACCEPT
-A FORWARD -i {up} -o {dn} -m conntrack --ctstate ESTABLISHED,RELATED --ctdir REPLY -j ACCEPT
-A FORWARD -p icmp -m conntrack --ctstate RELATED -j ACCEPT
-A FORWARD -i {dn} -o {up} -d {LINK_LOCAL} -j DROP
-A FORWARD -i {dn} -o {up} -d {LOOPBACK_NET} -j DROP
-A FORWARD -i {dn} -o {up} -d {pool_cidr} -j DROP
-A FORWARD {ctdir} -j {EGRESS_CHAIN}
{jump_private}-A FORWARD {ctdir} -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -i {up} -d {slot_address}/32 -j DNAT --to-destination {SANDBOX_IP}
-A POSTROUTING -o {up} -s {SANDBOX_IP}/32 -j MASQUERADE
COMMIT
"""


class HostChains:
    """Names and rules of one pool's chains in the root netns."""

    def __init__(self, prefix: str, pool_cidr: str = "") -> None:
        self.prefix = prefix
        self.pool_cidr = pool_cidr
        tag = prefix.upper()
        self.input = f"{tag}-INPUT"
        self.forward = f"{tag}-FORWARD"
        self.postrouting = f"{tag}-POSTROUTING"
        self.links = f"{prefix}h+"

    def jumps(self) -> dict[str, list[tuple[str, str, bool]]]:
        """table -> [(built-in chain, rule spec, at top?)] we add to built-in chains.

        Top of INPUT / FORWARD: our chains only drop (plus accept replies), so
        pools never shadow each other's drops. End of FORWARD: accept egress
        from our slots, for hosts whose FORWARD policy is DROP.
        """
        return {
            "filter": [
                ("INPUT", f"-i {self.links} -j {self.input}", True),
                ("FORWARD", f"-j {self.forward}", True),
                ("FORWARD", f"-i {self.links} -j ACCEPT", False),
            ],
            "nat": [("POSTROUTING", f"-s {self.pool_cidr} -j {self.postrouting}", True)],
        }

    def install(self, saved: str) -> str:
        """iptables-restore --noflush input that (re)installs our chains.

        Our chains are declared, hence flushed and refilled; jumps missing from
        ``saved`` (iptables-save output) are added, present ones left alone.
        """
        present = _rules_by_table(saved)
        links = self.links
        lines = {
            "filter": [
                f":{self.input} - [0:0]",
                f":{self.forward} - [0:0]",
                f"-A {self.input} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                f"-A {self.input} -j DROP",
                f"-A {self.forward} -o {links} -m conntrack --ctstate ESTABLISHED,RELATED"
                " -j ACCEPT",
                f"-A {self.forward} -o {links} -j DROP",
                f"-A {self.forward} -i {links} -d {self.pool_cidr} -j DROP",
                f"-A {self.forward} -i {links} -d 169.254.0.0/16 -j DROP",
                f"-A {self.forward} -i {links} -d 127.0.0.0/8 -j DROP",
            ],
            "nat": [
                f":{self.postrouting} - [0:0]",
                f"-A {self.postrouting} -o {links} -j RETURN",
                f"-A {self.postrouting} -p tcp -j CONNMARK --or-mark {EGRESS_CT_MARK:#x}",
                f"-A {self.postrouting} -j MASQUERADE",
            ],
        }
        for table, jumps in self.jumps().items():
            for chain, spec, top in jumps:
                if f"-A {chain} {spec}" in present.get(table, []):
                    continue
                lines[table].append(f"-I {chain} 1 {spec}" if top else f"-A {chain} {spec}")
        return "".join(f"*{t}\n" + "\n".join(ls) + "\nCOMMIT\n" for t, ls in lines.items())

    def remove(self, saved: str) -> str | None:
        """iptables-restore --noflush input removing our jumps and chains (None: nothing)."""
        present = _rules_by_table(saved)
        chains = _chains_by_table(saved)
        ours = {"filter": {self.input, self.forward}, "nat": {self.postrouting}}
        out = []
        for table, jumps in self.jumps().items():
            specs = {f"-A {chain} {spec}" for chain, spec, _ in jumps}
            lines = []
            for rule in present.get(table, []):
                chain, target = rule.split()[1], rule.split()[-1]
                if chain not in ours[table] and (rule in specs or target in ours[table]):
                    lines.append("-D" + rule[2:])
            for chain in sorted(ours[table] & chains.get(table, set())):
                lines += [f"-F {chain}", f"-X {chain}"]
            if lines:
                out.append(f"*{table}\n" + "\n".join(lines) + "\nCOMMIT\n")
        return "".join(out) or None


_TABLE = re.compile(r"^\*(\w+)$")


def _rules_by_table(saved: str) -> dict[str, list[str]]:
    table = ""
    rules: dict[str, list[str]] = {}
    for line in saved.splitlines():
        m = _TABLE.match(line)
        if m:
            table = m.group(1)
        elif line.startswith("-A "):
            rules.setdefault(table, []).append(line.strip())
    return rules


def _chains_by_table(saved: str) -> dict[str, set[str]]:
    table = ""
    chains: dict[str, set[str]] = {}
    for line in saved.splitlines():
        m = _TABLE.match(line)
        if m:
            table = m.group(1)
        elif line.startswith(":"):
            chains.setdefault(table, set()).add(line[1:].split()[0])
    return chains
