"""Per-sandbox egress policy: E2B's ``allowOut`` / ``denyOut`` as router-netns rules.

Semantics (E2B's): with no rules everything goes out; ``denyOut`` entries
(IPv4 addresses or CIDRs) are refused; ``allowOut`` entries (addresses, CIDRs or
domain names) always win over ``denyOut``. ``allow_internet_access = false`` is
``denyOut = ["0.0.0.0/0"]``.

Domains are matched by address, not by name: the node resolves each domain when
the policy is applied and again every ``egress_refresh_s`` seconds (node config,
default 60), and allows the addresses it got. Limits of that choice (for
docs/security.md): another name served from the same address is reachable
too; an address the sandbox's own resolver returns but the node's did not is
refused; wildcard names cannot be resolved and are rejected. When ``allowOut`` holds a domain, the
DNS servers (``dnsServers``, default 8.8.8.8) are allowed as E2B does.

Never overridable by any policy (router rules placed before it): link-local
(metadata-style) addresses, loopback, every slot of the node's pool, and the host
itself (its INPUT chain drops everything new from sandbox links).

Refused by default, but open to a policy (``allowOut`` entries) and to the operator
(``egress_private_open``): the private networks beyond the host where a cloud's
internal services live, RFC 1918 and carrier-grade NAT (``PRIVATE_NETS``; issue 29).
Sandboxes have no IPv6 (disabled in every slot's netns, nothing forwards it), so
unique-local (fc00::/7) and IPv6 link-local addresses have no route at all.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field

from .rules import EGRESS_CHAIN as CHAIN
from .rules import PRIVATE_CHAIN

ALL_TRAFFIC = "0.0.0.0/0"
_ALL_SPELLINGS = {"0.0.0.0/0", "0.0.0.0/0.0.0.0", "::/0"}
DEFAULT_DNS = ("8.8.8.8",)
MAX_ENTRIES = 256
MAX_DNS = 10
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


PRIVATE_NETS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")


def parse_opened(raw: str) -> tuple[str, ...]:
    """The operator's ``egress_private_open``: IPv4 CIDRs, comma-separated."""
    out = []
    for item in (x.strip() for x in raw.split(",")):
        if item:
            try:
                out.append(str(ipaddress.IPv4Network(item, strict=False)))
            except ValueError:
                raise PolicyError(f"egress_private_open entry {item!r} is not an IPv4 "
                                  "address or CIDR") from None
    return tuple(out)


def private_rules(opened: tuple[str, ...]) -> list[str]:
    """The router's ``AENV-PRIVATE`` chain: what the operator opened goes on (RETURN to
    the final ACCEPT), the rest of PRIVATE_NETS is refused as ``denyOut`` is."""
    lines = [f"-A {PRIVATE_CHAIN} -d {net} -j RETURN" for net in opened]
    lines += [f"-A {PRIVATE_CHAIN} -d {d} -p tcp -j REJECT --reject-with tcp-reset"
              for d in PRIVATE_NETS]
    lines += [f"-A {PRIVATE_CHAIN} -d {d} -j REJECT --reject-with icmp-admin-prohibited"
              for d in PRIVATE_NETS]
    return lines


class PolicyError(ValueError):
    """A policy entry is malformed or not supported (the API answers 400)."""


@dataclass(frozen=True)
class EgressPolicy:
    """What the user asked for (persisted in the sandbox record as given, normalised)."""

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] | None = None  # None: the default (8.8.8.8)

    @property
    def is_open(self) -> bool:
        return not self.allow_out and not self.deny_out

    @property
    def denies_all(self) -> bool:
        return ALL_TRAFFIC in self.deny_out

    @property
    def blocks_everything(self) -> bool:
        """Nothing may go out: the cheap policy-routing blackhole does it all."""
        return self.denies_all and not self.allow_out

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(a for a in self.allow_out if not _is_net(a))

    def to_json(self) -> dict:
        out: dict = {"allowOut": list(self.allow_out), "denyOut": list(self.deny_out)}
        if self.dns_servers is not None:
            out["dnsServers"] = list(self.dns_servers)
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> EgressPolicy:
        data = data or {}
        dns = data.get("dnsServers")
        return cls(tuple(data.get("allowOut") or ()), tuple(data.get("denyOut") or ()),
                   tuple(dns) if dns is not None else None)


@dataclass(frozen=True)
class CompiledPolicy:
    """A policy with its domains resolved: only addresses and networks."""

    policy: EgressPolicy
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    unresolved: tuple[str, ...] = field(default=())

    @property
    def blocks_everything(self) -> bool:
        return self.policy.blocks_everything


def parse_policy(allow_out: list | None, deny_out: list | None, dns_servers: list | None = None,
          allow_internet_access: bool | None = None) -> EgressPolicy:
    """Validate and normalise what a client sent; raises PolicyError."""
    allow = [_entry(a, "allowOut", domains=True) for a in _strings(allow_out, "allowOut")]
    deny = [_entry(d, "denyOut", domains=False) for d in _strings(deny_out, "denyOut")]
    if allow_internet_access is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    dns: tuple[str, ...] | None = None
    if dns_servers is not None:
        servers = _strings(dns_servers, "dnsServers")
        if len(servers) > MAX_DNS:
            raise PolicyError(f"dnsServers has {len(servers)} entries; at most {MAX_DNS}")
        for s in servers:
            try:
                ipaddress.IPv4Address(s)
            except ValueError:
                raise PolicyError(f"dnsServers entry {s!r} is not an IPv4 address") from None
        dns = tuple(servers)
    return EgressPolicy(tuple(dict.fromkeys(allow)), tuple(dict.fromkeys(deny)), dns)


def compile_policy(policy: EgressPolicy) -> CompiledPolicy:
    """Resolve the policy's domains (blocking: run it in a thread)."""
    allow: list[str] = []
    unresolved: list[str] = []
    for entry in policy.allow_out:
        if _is_net(entry):
            allow.append(entry)
            continue
        found = _resolve(entry)
        if not found:
            unresolved.append(entry)
        allow += [f"{a}/32" for a in found]
    if policy.domains:
        allow += [f"{s}/32" for s in (policy.dns_servers if policy.dns_servers is not None
                                      else DEFAULT_DNS)]
    return CompiledPolicy(policy, tuple(dict.fromkeys(allow)), policy.deny_out,
                          tuple(unresolved))


def chain_rules(compiled: CompiledPolicy | None) -> list[str]:
    """The body of the router's egress chain (iptables-restore lines, chain declared apart).

    Allowed destinations first (allow wins), then refusals (an ICMP error, so a
    connect fails at once instead of hanging), then everything else goes out.
    """
    if compiled is None:
        return []
    lines = [f"-A {CHAIN} -d {a} -j ACCEPT" for a in compiled.allow]
    lines += [f"-A {CHAIN} -d {d} -p tcp -j REJECT --reject-with tcp-reset"
              for d in compiled.deny]
    lines += [f"-A {CHAIN} -d {d} -j REJECT --reject-with icmp-admin-prohibited"
              for d in compiled.deny]
    return lines


def _strings(value: list | None, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{name} must be a list of strings")
    if len(value) > MAX_ENTRIES:
        raise PolicyError(f"{name} has {len(value)} entries; at most {MAX_ENTRIES} are allowed")
    return [v.strip() for v in value]


def _is_net(entry: str) -> bool:
    try:
        ipaddress.IPv4Network(entry, strict=False)
        return True
    except ValueError:
        return False


def _entry(raw: str, name: str, domains: bool) -> str:
    if raw in _ALL_SPELLINGS:
        return ALL_TRAFFIC
    try:
        net = ipaddress.ip_network(raw, strict=False)
    except ValueError:
        net = None
    if net is not None:
        if net.version != 4:
            raise PolicyError(f"{name} entry {raw!r}: only IPv4 is supported (sandboxes have "
                              "no IPv6)")
        return str(net)
    if not domains:
        raise PolicyError(f"{name} entry {raw!r} is not an IPv4 address or CIDR (domain names "
                          "are allowed in allowOut only)")
    host = raw.lower().rstrip(".")
    if host.startswith("*."):
        raise PolicyError(f"{name} entry {raw!r}: wildcard domains are not supported here "
                          "(domains are resolved to addresses); list the names")
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise PolicyError(f"{name} entry {raw!r} is not an IPv4 address, CIDR or domain name")
    return host


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})
