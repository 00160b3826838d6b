"""Where an image pull may send requests: the registry, its token realm, redirects.

A registry chooses its token realm (``WWW-Authenticate: Bearer realm=...``) and where
its answers redirect; a hostile one pointed them at the node's loopback and the node
fetched them (issue 29, finding 3). Every URL a pull requests is checked here first:

- its host must resolve to global addresses only: no loopback, private (RFC 1918),
  carrier-grade NAT (100.64/10), link-local, unique-local, multicast, reserved or
  unspecified address, and none of the node's own addresses (a bind tells);
- it must be https;

unless the operator listed it in ``registry_private`` (``host`` for any port,
``host:port`` for one) *and* the pull's registry is listed too: a public registry
can never bounce a pull into a private network, whatever the list says. The default
list is loopback's names (local mirrors and tests); ``registry_private = []`` refuses
loopback registries too. Names are resolved at the check; a name that resolves
differently at connect time (DNS rebinding) is not caught (see docs/security.md).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

import httpx

from .errors import RegistryUnavailable

DEFAULT_PRIVATE = ("localhost", "127.0.0.1", "::1")
MAX_REDIRECTS = 5


class RegistryTargetRefused(RegistryUnavailable):
    """A URL a pull would request that is not allowed (the message says why)."""

    status = 502


def _entry(entry: str) -> tuple[str, int | None]:
    """An entry's host and port (None: any): ``name``, ``1.2.3.4``, ``::1``,
    ``name:5000``, ``[::1]:5000``."""
    e = entry.strip().lower()
    if e.startswith("["):
        host, _, rest = e[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif e.count(":") == 1:
        host, _, port = e.partition(":")
    else:
        host, port = e, ""
    return host, int(port) if port.isdigit() else None


def _own_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is one of this host's (binding to it succeeds only then)."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast and not _own_address(ip)


@dataclass(frozen=True)
class RegistryPolicy:
    """``private``: the ``host`` / ``host:port`` entries the operator allows to be
    private and plain http (``registry_private``)."""

    private: tuple[str, ...] = DEFAULT_PRIVATE

    def listed(self, host: str, port: int) -> bool:
        name = host.strip("[]").lower()
        return any(e_host == name and e_port in (None, port)
                   for e_host, e_port in map(_entry, self.private))

    def registry_listed(self, registry: str) -> bool:
        url = httpx.URL(f"https://{registry}/")
        return self.listed(url.host, url.port or 443) or \
            (url.port is None and self.listed(url.host, 80))

    def check(self, url: httpx.URL, registry: str, what: str) -> None:
        """Raise RegistryTargetRefused unless a pull from ``registry`` may request ``url``."""
        host, port = url.host, url.port or (443 if url.scheme == "https" else 80)
        allowed = self.registry_listed(registry) and self.listed(host, port)
        if url.scheme not in ("http", "https"):
            raise RegistryTargetRefused(f"{registry}: {what} is not an http(s) URL; refused")
        if url.scheme != "https" and not allowed:
            raise RegistryTargetRefused(f"{registry}: {what} is plain http; only https is "
                                        "allowed (or list the registry in registry_private)")
        if allowed:
            return
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise RegistryUnavailable(f"{registry}: {what}: cannot resolve {host}: {exc}"
                                      ) from exc
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if not _public(ip):
                raise RegistryTargetRefused(
                    f"{registry}: {what} is on a loopback, private, link-local or this "
                    "node's own address; refused (an operator can allow a registry with "
                    "registry_private)")


_default = RegistryPolicy()


def default_policy() -> RegistryPolicy:
    return _default


def set_default_policy(policy: RegistryPolicy) -> None:
    """The node's policy, from its configuration (``registry_private``), for every
    client made without one."""
    global _default
    _default = policy
