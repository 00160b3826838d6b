"""The Host a sandbox's port sees, as E2B's proxy sets it: the client's own Host, or the
sandbox's ``maskRequestHost`` (``${PORT}`` replaced by the port) with the client's Host
in ``X-Forwarded-Host``. envd's port always sees the client's Host."""

from __future__ import annotations

import ipaddress
import re

PORT_PLACEHOLDER = "${PORT}"
MAX_MASK_LENGTH = 255
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


class BadMask(ValueError):
    """A maskRequestHost that is not a host[:port] once ``${PORT}`` is replaced."""


def masked_host(mask: str, port: int) -> str:
    return mask.replace(PORT_PLACEHOLDER, str(port))


def check_mask_host(mask: object) -> str:
    """The mask, if every port makes it a valid ``host[:port]`` (ASCII name, IPv4 or
    ``[IPv6]``; port 1-65535); else BadMask. The result goes into a Host header."""
    if not isinstance(mask, str):
        raise BadMask("must be a string")
    if len(mask) > MAX_MASK_LENGTH:
        raise BadMask(f"has {len(mask)} characters; at most {MAX_MASK_LENGTH}")
    for port in (1, 65535):  # the shortest and the longest replacement
        host = masked_host(mask, port)
        if not _valid_host_port(host):
            raise BadMask(f"{host!r} (with {PORT_PLACEHOLDER} = {port}) is not a valid "
                          "host or host:port")
    return mask


def _valid_host_port(value: str) -> bool:
    host, port = value, ""
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            return False
        port = rest[1:] if rest else ""
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
    else:
        if value.count(":") > 1:
            return False
        host, _, port = value.partition(":")
        if not _NAME.fullmatch(host) or len(host) > 253:
            return False
        if ":" in value and not port:
            return False
    return not port or (_PORT.fullmatch(port) is not None and 0 < int(port) < 65536)


def upstream_host(client_host: str | None, mask: str, port: int, envd_port: int
                  ) -> tuple[str | None, str | None]:
    """``(Host, X-Forwarded-Host)`` for the request a sandbox's port receives (None:
    leave the header out, the relay then names the upstream)."""
    if mask and port != envd_port:
        return masked_host(mask, port), client_host
    return client_host, None
